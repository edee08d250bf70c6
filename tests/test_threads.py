"""The cpu thread knob: LLM(cpu_threads=), --threads, $MINDSPEC_CPU_THREADS, ModelConfig.cpuThreads,
its precedence, bad values, dp's per-rank split, and OMP_WAIT_POLICY=PASSIVE by default."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspec import LLM
from mindspec.backends.cpu.backend import THREADS_ENV, set_cpu_threads, usable_cores
from mindspec.distributed.launch import share_host_cores

SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "mindspec" / "assets" / "default_model"
CORES = len(os.sched_getaffinity(0))  # what the default policy must use (counted here, not by the code)


@pytest.fixture(autouse=True)
def restore_threads(monkeypatch):
    # the thread count is per process: leave it as found for the tests that run after these
    for var in (THREADS_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _llm(**kw):
    return LLM(progress=False, num_blocks=16, **kw)


def _config(tmp_path, threads):
    model = {"modelWeightPath": str(SHIPPED_MODEL), "backendType": "cpu", "dtype": "float32", "cpuThreads": threads}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [model]},
                                                  "ScheduleConfig": {"numBlocks": 16}}}))
    return path


# ---- precedence: keyword / --threads > $MINDSPEC_CPU_THREADS > cpuThreads > default --------------------


def test_default_is_one_thread_for_a_small_model():
    torch.set_num_threads(CORES + 3)
    _llm()  # the shipped model: hidden size 192
    assert torch.get_num_threads() == 1


def test_default_keeps_torchs_count_for_a_larger_model(tmp_path):
    # one process: what torch has (OMP_NUM_THREADS, an earlier torch.set_num_threads, else the cores)
    from mindspec.engine.args import EngineArgs

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    args = EngineArgs(model=str(tmp_path))
    assert args.model_hidden_size() == 4096
    torch.set_num_threads(CORES + 3)
    assert args.apply_cpu_threads() == CORES + 3 == torch.get_num_threads()
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 1023}))
    assert args.apply_cpu_threads() == 1
    (tmp_path / "config.json").write_text("not json")  # unreadable: torch's count (the loader reports it)
    torch.set_num_threads(CORES + 2)
    assert args.model_hidden_size() is None and args.apply_cpu_threads() == CORES + 2


def test_keyword_env_and_config_in_order(tmp_path, monkeypatch):
    _llm(cpu_threads=3)
    assert torch.get_num_threads() == 3
    monkeypatch.setenv(THREADS_ENV, "5")
    _llm()
    assert torch.get_num_threads() == 5
    _llm(cpu_threads=3)  # the keyword beats the environment
    assert torch.get_num_threads() == 3
    LLM(config=_config(tmp_path, 4), progress=False)  # the environment beats the config
    assert torch.get_num_threads() == 5
    monkeypatch.delenv(THREADS_ENV)
    LLM(config=_config(tmp_path, 4), progress=False)
    assert torch.get_num_threads() == 4
    LLM(config=_config(tmp_path, 4), cpu_threads=6, progress=False)
    assert torch.get_num_threads() == 6


@pytest.mark.parametrize("value", [0, -2, True, 2.0, "2"])
def test_bad_keyword_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="cpu_threads: must be an integer >= 1"):
        _llm(cpu_threads=value)


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_bad_env_is_a_value_error_naming_it(raw, monkeypatch):
    monkeypatch.setenv(THREADS_ENV, raw)
    with pytest.raises(ValueError, match=f"\\${THREADS_ENV}: must be an integer >= 1"):
        _llm()


def test_bad_config_value_names_the_key(tmp_path):
    from mindspec.config.mindie_config import ConfigError

    with pytest.raises(ConfigError, match="cpuThreads"):
        LLM(config=_config(tmp_path, 0), progress=False)


# ---- dp: ranks on one host split the cores unless a count was given --------------------------------


def test_share_host_cores_splits_unless_a_count_is_given(monkeypatch):
    share_host_cores("cpu", 2)
    assert torch.get_num_threads() == max(1, CORES // 2)
    torch.set_num_threads(CORES + 1)
    share_host_cores("cpu", 2, hidden_size=192)  # a small model: one thread per rank
    assert torch.get_num_threads() == 1
    monkeypatch.setenv(THREADS_ENV, "3")  # an explicit count is each rank's own
    share_host_cores("cpu", 2)
    assert torch.get_num_threads() == 3
    monkeypatch.delenv(THREADS_ENV)
    torch.set_num_threads(7)
    share_host_cores("cuda", 2)  # other backends leave the host threads alone
    assert torch.get_num_threads() == 7


def test_torchrun_splits_by_the_ranks_on_this_host(monkeypatch):
    for var, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(var, value)
    torch.set_num_threads(CORES + 1)  # what torch has here (earlier tests may have changed it)
    share_host_cores("cpu", 4)  # four ranks, one per host: each keeps torch's count for its host
    assert torch.get_num_threads() == CORES + 1


@pytest.mark.slow
def test_dp_llm_keeps_the_split_and_the_keyword():
    # rank 0 runs here; with dp=2 the default for the (small) shipped model is one thread per rank,
    # cpu_threads stays as given
    with LLM(dp=2, progress=False, num_blocks=16) as llm:
        assert torch.get_num_threads() == 1
        assert llm.generate("def f(x):")[0].finished
    with LLM(dp=2, cpu_threads=CORES + 1, progress=False, num_blocks=16):
        assert torch.get_num_threads() == CORES + 1
    assert THREADS_ENV not in os.environ  # handed to the ranks while they started, not left behind


def test_dp_split_counts_the_affinity_mask():
    assert usable_cores() == CORES
    assert set_cpu_threads(None, ranks_on_host=2) == max(1, CORES // 2) == torch.get_num_threads()


# ---- the command line ----------------------------------------------------------------------------------


def _run(*args, env=None):
    exe = shutil.which("mindspec")
    cmd = [exe] if exe else [sys.executable, "-m", "mindspec.cli"]
    drop = (THREADS_ENV, "MINDSPEC_DEBUG", "OMP_NUM_THREADS")
    full_env = {k: v for k, v in os.environ.items() if k not in drop} | (env or {})
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300, env=full_env)


def _threads_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "cpu threads:" in line]
    assert len(lines) == 1, stderr
    return lines[0]


def test_cli_default_for_the_shipped_model_is_one_thread():
    res = _run("--log-level", "INFO", "generate", "--prompt", "x", "--max-tokens", "2")
    assert res.returncode == 0, res.stderr
    assert "cpu threads: 1 (default: a small model (hidden size 192)" in _threads_line(res.stderr)


def test_cli_threads_and_env():
    res = _run("--log-level", "INFO", "generate", "--threads", "1", "--prompt", "x", "--max-tokens", "2",
               env={THREADS_ENV: "2"})
    assert res.returncode == 0, res.stderr
    assert "cpu threads: 1 (requested" in _threads_line(res.stderr)  # --threads beats the environment
    res = _run("--log-level", "INFO", "generate", "--prompt", "x", "--max-tokens", "2", env={THREADS_ENV: "3"})
    assert res.returncode == 0, res.stderr
    assert f"cpu threads: 3 (${THREADS_ENV}" in _threads_line(res.stderr)


def test_cli_serve_threads_apply_before_the_server_starts():
    # the port is taken, so serve stops right after setting threads, before loading the model
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        res = _run("--log-level", "INFO", "serve", "--threads", "1", "--port", port, "--management-port", port,
                   "--metrics-port", port)
    assert res.returncode == 2 and "cpu threads: 1 (requested" in _threads_line(res.stderr)


@pytest.mark.parametrize("args, env, needle", [
    (["--threads", "0"], {}, "cpu_threads: must be an integer >= 1"),
    ([], {THREADS_ENV: "many"}, f"${THREADS_ENV}: must be an integer >= 1"),
])
def test_cli_bad_threads_is_one_line(args, env, needle):
    res = _run("generate", *args, "--prompt", "x", env=env)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr


def test_cli_threads_must_be_an_integer():
    res = _run("generate", "--threads", "lots", "--prompt", "x")
    assert res.returncode == 2 and "--threads: invalid int value: 'lots'" in res.stderr


# ---- OMP_WAIT_POLICY -------------------------------------------------------------------------------------


@pytest.mark.parametrize("code, env, expected", [
    ("import mindspec, torch", {}, "PASSIVE passive"),
    ("import torch, mindspec", {}, "PASSIVE too late"),  # OpenMP read its environment when torch loaded
    ("import mindspec, torch", {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE user"),  # the user's value is kept
    ("import mindspec, torch", {"GOMP_SPINCOUNT": "300000"}, "None user"),  # a spin count is a choice too
])
def test_wait_policy_is_passive_unless_set(code, env, expected):
    full_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    out = subprocess.run([sys.executable, "-c", code + "; import os; print(os.environ.get('OMP_WAIT_POLICY'), "
                          "mindspec.WAIT_POLICY_SOURCE)"], capture_output=True, text=True, env=full_env, timeout=120)
    assert out.stdout.strip() == expected, out.stderr
