"""`mindspec serve`: build the engine from a MindIE config and serve it on its ports."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Optional

import uvicorn

from mindspec.config.mindie_config import MindieConfig, load_config
from mindspec.distributed import launch
from mindspec.distributed.parallel_config import MODEL_CONFIG_PATH
from mindspec.engine.args import EngineArgs

from .app import apps_by_port
from .async_engine import AsyncEngine
from .metrics import ServiceMetrics
from .pd_config import check_pd, pd_plugin_params
from .pd_node import inter_comm_app
from .pd_router import PdRouter
from .runner import RequestRunner, Timeouts
from .state import ServiceState

logger = logging.getLogger(__name__)
CONFIG_ENV = "MIES_CONFIG_JSON_PATH"


def resolve_config(path: Optional[str]) -> MindieConfig:
    """--config, else $MIES_CONFIG_JSON_PATH, else the built-in default (the shipped model). A
    name that is not a file but a shipped config's ("config_cpu_no_mtp") loads that config."""
    from mindspec.config.defaults import default_config, find_config

    path = path or os.environ.get(CONFIG_ENV)
    if path:
        return load_config(find_config(path))
    return default_config()


def engine_args(config: MindieConfig) -> EngineArgs:
    args = EngineArgs.from_mindie_config(config, progress=False)
    role = check_pd(config)
    if role in ("prefill", "decode"):
        args.plugin_params = pd_plugin_params(args.plugin_params, role)
    return args


def build_engine(config: MindieConfig):
    """One process; rank 0 of spawned local ranks (worldSize > 1); rank 0 under torchrun."""
    args, parallel = engine_args(config), config.model.parallel
    if launch.torchrun_env() is not None:
        return launch.join_torchrun(args, parallel, MODEL_CONFIG_PATH)
    return launch.build_engine(args, parallel, MODEL_CONFIG_PATH)


def build_state(config: MindieConfig, api_key: Optional[str] = None) -> ServiceState:
    metrics = ServiceMetrics()
    if check_pd(config) == "router":  # no model here: requests go through the PD nodes
        async_engine = PdRouter.from_config(config)
    else:
        engine = build_engine(config)
        structured = getattr(engine, "structured", None)
        if structured is not None:
            structured.warm_in_background()
        async_engine = AsyncEngine(engine, metrics)
    server = config.server
    runner = RequestRunner(async_engine, metrics, Timeouts(token=server.token_timeout, e2e=server.e2e_timeout))
    return ServiceState(engine=async_engine, runner=runner, metrics=metrics, model_name=config.model.model_name,
                        max_seq_len=config.backend.model_deploy.max_seq_len, api_key=api_key)


def listen_host(server_cfg, port: int) -> str:
    """The business port (and a port merged with it, and the PD routes) listen on ipAddress; the
    management and metrics ports on managementIpAddress (MindIE's business/management split)."""
    pd_routes = server_cfg.pd_role in ("prefill", "decode") and port == server_cfg.inter_comm_port
    if port == server_cfg.port or pd_routes:
        return server_cfg.ip_address
    return server_cfg.management_ip_address


def _url(host: str, port: int, https: bool) -> str:
    return f"{'https' if https else 'http'}://{'[' + host + ']' if ':' in host else host}:{port}"


def uvicorn_config(app, host: str, port: int, tls) -> uvicorn.Config:
    """One port's uvicorn config; ``tls`` (mindspec.config.tls.ServerTls or None) turns on HTTPS."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            **(tls.uvicorn_kwargs() if tls else {}))
    if tls is not None and len(tls.ca_files) > 1:
        config.load()  # builds the SSLContext now: uvicorn takes one CA file, MindIE's tlsCaFile up to 3
        tls.load_extra_cas(config.ssl)
    return config


async def serve(config: MindieConfig, api_key: Optional[str] = None) -> None:
    server_cfg = config.server
    state = build_state(config, api_key)
    apps = apps_by_port(state, server_cfg.port, server_cfg.management_port, server_cfg.metrics_port,
                        server_cfg.max_request_length_bytes, server_cfg.max_link_num)
    role = server_cfg.pd_role
    if role in ("prefill", "decode"):  # the PD routes, on a port of their own
        apps[server_cfg.inter_comm_port] = inter_comm_app(state, role)
    hosts = {port: listen_host(server_cfg, port) for port in apps}
    servers = [uvicorn.Server(uvicorn_config(app, hosts[port], port, server_cfg.tls_for_port(port)))
               for port, app in apps.items()]
    for s in servers:
        s.install_signal_handlers = lambda: None  # one handler below stops them all
    print(_banner(config, state), flush=True)
    https = server_cfg.tls is not None
    print("listening on " + ", ".join(_url(hosts[p], p, https) for p in apps), flush=True)
    state.engine.start()
    loop = asyncio.get_running_loop()

    def stop(*_):
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        state.engine.shutdown()
        close = getattr(getattr(state.engine, "engine", None), "close", None)  # dp ranks
        if close is not None:
            close()
        print("mindspec stopped", flush=True)


def _banner(config: MindieConfig, state: ServiceState) -> str:
    model, server = config.model, config.server
    if server.pd_role == "router":
        return (f"mindspec PD router for {model.model_name}: prefill node {server.pd_prefill_address}, "
                f"decode node {server.pd_decode_address}")
    engine = state.engine.engine
    plugins = ", ".join(p.name for p in engine.plugin_manager.plugins) or "none"
    line = (f"mindspec serving {model.model_name} ({model.model_weight_path}) on backend {model.backend_type}, "
            f"plugins: {plugins}")
    if server.pd_role:
        line += f"; PD {server.pd_role} node, PD routes on port {server.inter_comm_port}"
    if model.parallel.is_distributed:
        ranks = ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(getattr(engine, "workers", []), start=1))
        line += f"; dp={model.dp} moe_ep={model.moe_ep} ({ranks or 'torchrun ranks'})"
    return line


def run(config_path: Optional[str] = None, api_key: Optional[str] = None) -> int:
    config = resolve_config(config_path)
    torchrun = launch.torchrun_env()
    if torchrun is not None and torchrun[0] != 0:  # a follower rank: no HTTP, rank 0's steps
        return launch.follow(launch.join_torchrun(engine_args(config), config.model.parallel, MODEL_CONFIG_PATH))
    asyncio.run(serve(config, api_key or os.environ.get("MINDSPEC_API_KEY")))
    return 0
