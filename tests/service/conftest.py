"""A real `mindspec serve` in a subprocess on 127.0.0.1, random free ports, tiny checkpoint."""
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.checkpoints import make_checkpoint, tiny_v3_config
from tests.support.ports import free_port  # noqa: F401  (the tests import it from here)
from tests.support.tokenizers import make_tokenizer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("svc_model"), tiny_v3_config(initializer_range=0.2), seed=2)
    make_tokenizer(path, vocab_size=256)
    return path


def write_config(path, model_dir, ports, **overrides):
    cfg = {
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": ports[0], "managementPort": ports[1], "metricsPort": ports[2],
                         "maxLinkNum": 64, "maxRequestLength": 1},
        "BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": 512, "maxInputTokenLen": 128, "ModelConfig": [{
                "modelName": "tiny", "modelWeightPath": str(model_dir), "dtype": "float32", "backendType": "cpu",
                "plugin_params": {"plugin_type": "mtp", "num_speculative_tokens": 1}}]},
            "ScheduleConfig": {"cacheBlockSize": 16, "numBlocks": 200, "maxBatchSize": 48, "maxPrefillTokens": 4096,
                               "maxPrefillBatchSize": 48},
        },
    }
    for dotted, value in overrides.items():
        node = cfg
        keys = dotted.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        node[keys[-1]] = value
    path.write_text(json.dumps(cfg))
    return path


def start_serve(config_path, probe, args=(), env=None) -> subprocess.Popen:
    """``mindspec serve --config config_path [args]`` in a subprocess, returned once ``probe()``
    (an HTTP request) answers 200; env: variables added to this process's environment."""
    cmd = [sys.executable, "-m", "mindspec.cli", "serve", "--config", str(config_path), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if probe().status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start")


def stop_serve(proc: subprocess.Popen) -> str:
    """SIGTERM, a clean exit within 30 s (asserted), and the server's output."""
    proc.terminate()
    try:
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.stdout.read()


class Server:
    def __init__(self, config_path, ports, api_key=None):
        self.ports = ports
        self.base = f"http://127.0.0.1:{ports[0]}"
        self.mgmt = f"http://127.0.0.1:{ports[1]}"
        self.metrics_url = f"http://127.0.0.1:{ports[2]}/metrics"
        self.proc = start_serve(config_path, lambda: httpx.get(self.mgmt + "/health", timeout=1),
                                ["--api-key", api_key] if api_key else ())

    def healthy(self) -> bool:
        return httpx.get(self.mgmt + "/health", timeout=5).status_code == 200

    def metric(self, name, **labels) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.metrics_url, timeout=5).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def stop(self, sig=signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    ports = (free_port(), free_port(), free_port())
    cfg = write_config(tmp_path_factory.mktemp("svc") / "config.json", tiny_model, ports)
    srv = Server(cfg, ports)
    yield srv
    assert srv.stop() == 0
