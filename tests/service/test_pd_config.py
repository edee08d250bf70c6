"""PD roles in config.json (ServerConfig.inferMode "dmi" + pdRole): the shipped examples parse;
every bad combination is one ConfigError naming its JSON path; `mindspec serve` reports it in one
line."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mindspec.config.mindie_config import ConfigError, load_config, parse_config
from mindspec.service.pd_config import check_pd, pd_plugin_params

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODEL = "BackendConfig.ModelDeployConfig.ModelConfig[0]"


def _config(server=None, **model) -> dict:
    d = json.loads((CONFIGS / "config.json").read_text())
    d["ServerConfig"].update(server or {})
    d["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update(model)
    return d


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_pd_example_configs(role):
    cfg = load_config(CONFIGS / f"config_pd_{role}.json")
    assert cfg.server.infer_mode == "dmi" and check_pd(cfg) == role
    assert (cfg.model.kv_trans_timeout, cfg.model.kv_link_timeout) == (10.0, 60.0)
    if role == "router":
        assert (cfg.server.pd_prefill_address, cfg.server.pd_decode_address) == ("127.0.0.1:1121", "127.0.0.1:1122")


def test_mindie_decoder_spelling_and_mtp_role():
    cfg = parse_config(_config({"inferMode": "dmi", "pdRole": "decoder", "interCommPort": 1200}))
    assert cfg.server.pd_role == "decode" and cfg.server.inter_comm_port == 1200
    assert pd_plugin_params(cfg.model.plugin_params, "decode")["pd_role"] == "decode"
    assert pd_plugin_params(None, "prefill") is None  # no MTP: nothing to set


@pytest.mark.parametrize("server, message", [
    ({"inferMode": "dmi"}, "ServerConfig.pdRole: inferMode 'dmi' needs one of prefill, decode, router, got None"),
    ({"inferMode": "dmi", "pdRole": "flex"}, "ServerConfig.pdRole: inferMode 'dmi' needs one of"),
    ({"pdRole": "prefill"}, "ServerConfig.pdRole: a PD role needs ServerConfig.inferMode 'dmi'"),
    ({"inferMode": "pd"}, "ServerConfig.inferMode: must be one of standard, dmi"),
    ({"inferMode": "dmi", "pdRole": "router", "pdDecodeAddress": "127.0.0.1:2"},
     "ServerConfig.pdPrefillAddress: a PD router needs the node's host:port"),
    ({"inferMode": "dmi", "pdRole": "router", "pdPrefillAddress": "localhost", "pdDecodeAddress": "h:2"},
     "ServerConfig.pdPrefillAddress: must be host:port, got 'localhost'"),
    ({"inferMode": "dmi", "pdRole": "prefill", "interCommPort": 0}, "ServerConfig.interCommPort: must be in 1..65535"),
])
def test_bad_pd_server_values_name_their_path(server, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(_config(server))


@pytest.mark.parametrize("server, model, message", [
    ({"pdRole": "decode", "interCommPort": 1025}, {}, "ServerConfig.interCommPort: 1025 is already the business"),
    ({"pdRole": "prefill"}, {"worldSize": 2}, f"{MODEL}.worldSize: a PD prefill node runs with worldSize 1"),
    ({"pdRole": "router", "pdPrefillAddress": "h:1", "pdDecodeAddress": "h:1"}, {},
     "ServerConfig.pdDecodeAddress: must differ from pdPrefillAddress"),
])
def test_pd_conflicts_with_the_rest_of_the_config(server, model, message):
    cfg = parse_config(_config({"inferMode": "dmi", **server}, **model))
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_pd(cfg)


def test_explicit_mtp_role_must_match_the_node():
    with pytest.raises(ConfigError, match=re.escape(f"{MODEL}.plugin_params.pd_role: 'prefill' on a decode node")):
        pd_plugin_params({"plugin_type": "mtp", "num_speculative_tokens": 1, "pd_role": "prefill"}, "decode")


def test_serve_reports_a_bad_pd_config_in_one_line(tmp_path):
    d = _config({"inferMode": "dmi", "pdRole": "router"})
    d["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = str(
        (CONFIGS / "../mindspec/assets/default_model").resolve())
    (tmp_path / "c.json").write_text(json.dumps(d))
    res = subprocess.run([sys.executable, "-m", "mindspec.cli", "serve", "--config", str(tmp_path / "c.json")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("mindspec: error: ServerConfig.pdPrefillAddress")
    assert "Traceback" not in res.stderr
