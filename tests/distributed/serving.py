"""Real `mindspec serve` processes for the dp and PD tests: random free ports on 127.0.0.1, output
to a log file (never a pipe nobody drains), started together and awaited together."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.ports import free_port


def served_model(directory: Path, seed: int) -> Path:
    """A tiny self-predicting checkpoint (2 MTP modules) with a tokenizer, for served tests."""
    from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config
    from tests.support.tokenizers import make_tokenizer

    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=2)
    path = make_self_predicting_checkpoint(directory, cfg, seed=seed, residual_scale=0.005)
    make_tokenizer(path, vocab_size=256)
    return path


def write_config(path: Path, model_dir, *, server=None, model=None, schedule=None) -> tuple[Path, tuple[int, int, int]]:
    ports = (free_port(), free_port(), free_port())
    cfg = {
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": ports[0], "managementPort": ports[1], "metricsPort": ports[2],
                         "maxLinkNum": 64, "tokenTimeout": 60, "e2eTimeout": 120, **(server or {})},
        "BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": 256, "maxInputTokenLen": 128, "ModelConfig": [{
                "modelName": "tiny", "modelWeightPath": str(model_dir), "dtype": "float32", "backendType": "cpu",
                **(model or {})}]},
            "ScheduleConfig": {"cacheBlockSize": 4, "numBlocks": 400, "maxBatchSize": 32, "maxPrefillTokens": 2048,
                               "maxPrefillBatchSize": 32, **(schedule or {})},
        },
    }
    path.write_text(json.dumps(cfg))
    return path, ports


class ServerProc:
    def __init__(self, config_path: Path, ports: tuple[int, int, int], log_path: Path):
        self.ports, self.log_path = ports, log_path
        self.base = f"http://127.0.0.1:{ports[0]}"
        self.mgmt = f"http://127.0.0.1:{ports[1]}"
        self.metrics_url = f"http://127.0.0.1:{ports[2]}/metrics"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "mindspec.cli", "serve", "--config", str(config_path)],
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def health(self) -> int:
        return httpx.get(self.mgmt + "/health", timeout=10).status_code

    def wait_healthy(self, deadline: float) -> None:
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.log()}")
            try:
                if self.health() == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server did not start: {self.log()}")

    def rank_pids(self) -> list[int]:
        """Spawned dp ranks, from the banner ('rank 1 pid N')."""
        return [int(p) for p in re.findall(r"rank \d+ pid (\d+)", self.log())]

    def metric(self, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.metrics_url, timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = -9
        self._log.close()
        return code


def start_servers(specs: list[tuple[Path, tuple[int, int, int], Path]], timeout: float = 180) -> list[ServerProc]:
    servers = [ServerProc(*spec) for spec in specs]
    deadline = time.time() + timeout
    try:
        for s in servers:
            s.wait_healthy(deadline)
    except Exception:
        for s in servers:
            s.stop(signal.SIGKILL, 5)
        raise
    return servers


def completion(base: str, prompt, max_tokens: int = 16, timeout: float = 120, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(base + "/v1/completions", json=body, timeout=timeout)
