"""PD roles from config.json (ServerConfig.inferMode "dmi" + pdRole), checked against the rest of
the config; every conflict is one ConfigError naming its JSON path."""
from __future__ import annotations

from typing import Optional

from mindspec.config.mindie_config import ConfigError, MindieConfig
from mindspec.config.plugin_params import parse_plugin_params
from mindspec.distributed.parallel_config import MODEL_CONFIG_PATH

# the MTP plugin's pd_role for each node role (MindIE: both P and D must configure MTP)
MTP_ROLE = {"prefill": "prefill", "decode": "decode"}


def check_pd(config: MindieConfig) -> Optional[str]:
    """-> the node's PD role (None: a standard instance)."""
    server, model = config.server, config.model
    role = server.pd_role
    if role is None:
        return None
    if role in MTP_ROLE and model.parallel.is_distributed:
        raise ConfigError(f"{MODEL_CONFIG_PATH}worldSize: a PD {role} node runs with worldSize 1 "
                          f"(got {model.world_size}); scale with more nodes")
    if role in MTP_ROLE and server.inter_comm_port in (server.port, server.management_port, server.metrics_port):
        raise ConfigError(f"ServerConfig.interCommPort: {server.inter_comm_port} is already the business, "
                          f"management or metrics port; PD routes need a port of their own")
    if role == "router" and server.pd_prefill_address == server.pd_decode_address:
        raise ConfigError("ServerConfig.pdDecodeAddress: must differ from pdPrefillAddress")
    return role


def pd_plugin_params(raw, role: str):
    """plugin_params with the MTP plugin's pd_role set for this node (an explicit, different
    pd_role is a ConfigError)."""
    params = parse_plugin_params(raw)
    if "mtp" not in params.plugin_types:
        return raw
    want = MTP_ROLE[role]
    given = params.options.get("pd_role", want)
    if given != want:
        raise ConfigError(f"{MODEL_CONFIG_PATH}plugin_params.pd_role: {given!r} on a {role} node "
                          f"(ServerConfig.pdRole); use {want!r} or leave it out")
    return params.as_dict(pd_role=want)
