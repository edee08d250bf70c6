"""Where `mindspec serve` gets its config: --config, else $MIES_CONFIG_JSON_PATH, else the default."""
import signal

import httpx

from mindspec.config.defaults import DEFAULT_MODEL_DIR
from mindspec.service.server import CONFIG_ENV, resolve_config
from tests.service.conftest import Server, free_port, write_config


def test_default_is_the_shipped_model(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    cfg = resolve_config(None)
    assert cfg.model.model_weight_path == str(DEFAULT_MODEL_DIR) and "mtp" in cfg.model.plugin_params


def test_environment_variable_is_used(monkeypatch, tiny_model, tmp_path):
    path = write_config(tmp_path / "c.json", tiny_model, (1, 2, 3))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert resolve_config(None).model.model_name == "tiny"
    assert resolve_config(str(path)).server.port == 1


def test_shipped_config_by_name(monkeypatch, tmp_path):
    """`mindspec serve --config config_cpu_no_mtp` from any folder: the ready-made config."""
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config("config_cpu_no_mtp")
    assert cfg.source.endswith("config_cpu_no_mtp.json") and cfg.model.plugin_params is None
    assert cfg.model.model_weight_path == str(DEFAULT_MODEL_DIR)
    monkeypatch.setenv(CONFIG_ENV, "config_npu")
    assert resolve_config(None).model.backend_type == "npu"


def test_serve_default_model(tmp_path):
    """The shipped model behind a real server, as the README's curl shows it; Ctrl-C stops it cleanly."""
    ports = (free_port(), free_port(), free_port())
    cfg = write_config(tmp_path / "c.json", DEFAULT_MODEL_DIR, ports, **{
        "BackendConfig.ModelDeployConfig.ModelConfig.0.plugin_params": {"plugin_type": "mtp", "num_speculative_tokens": 3}})
    srv = Server(cfg, ports)
    try:
        r = httpx.post(srv.base + "/v1/completions", timeout=120,
                       json={"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 10
        assert srv.metric("mindspec_spec_accepted_tokens_total") > 0
    finally:
        assert srv.stop(signal.SIGINT) == 0
    banner = srv.proc.stdout.read()
    assert f"listening on http://127.0.0.1:{ports[0]}" in banner and "backend cpu" in banner, banner
    assert "mtp" in banner and "mindspec stopped" in banner, banner
