"""`mindspec generate` as a user runs it: the installed console script, a real checkpoint dir."""
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import make_checkpoint, tiny_v3_config
from tests.support.tokenizers import make_tokenizer

SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "mindspec" / "assets" / "default_model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("cli"), tiny_v3_config(), seed=2)
    make_tokenizer(path, vocab_size=256)
    return path


def _run(*args, env=None):
    exe = shutil.which("mindspec")
    cmd = [exe] if exe else [sys.executable, "-m", "mindspec.cli"]
    # A developer's MINDSPEC_DEBUG must not turn the one-line errors checked here into tracebacks,
    # and TRITON_INTERPRET (set process-wide by tests/backends/cuda/conftest.py when those tests
    # ran first) would let --backend cuda run on this CPU.
    inherited = {k: v for k, v in os.environ.items() if k not in ("MINDSPEC_DEBUG", "TRITON_INTERPRET")}
    full_env = inherited | (env or {})
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300, env=full_env)


def test_generate_prints_text(model_dir):
    from mindspec import LLM, SamplingParams

    res = _run("generate", "--model", str(model_dir), "--prompt", "def add(a, b):", "--max-tokens", "12",
               "--ignore-eos", "--dtype", "float32", "--num-blocks", "64")
    assert res.returncode == 0, res.stderr
    llm = LLM(model=str(model_dir), dtype="float32", num_blocks=64, progress=False)
    expected = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    assert res.stdout == expected + "\n"


def test_bad_sampling_value_is_named(model_dir):
    res = _run("generate", "--model", str(model_dir), "--prompt", "hi", "--temperature", "-1")
    assert res.returncode == 2 and "temperature" in res.stderr and "Traceback" not in res.stderr


# ---- user errors: one line on stderr, exit code 2, a traceback only with --debug ---------------------


def _one_line_error(res, *needles):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("mindspec: error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_backend_npu_applies_to_the_shipped_model():
    # No --model: the shipped model, which must not silently stay on cpu.
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed; the error path needs a machine without it")
    res = _run("generate", "--backend", "npu", "--prompt", "x", "--max-tokens", "2")
    _one_line_error(res, "npu", "torch_npu")


def test_backend_cuda_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible; the error path needs a machine without one")
    res = _run("generate", "--model", str(SHIPPED_MODEL), "--backend", "cuda", "--prompt", "x")
    _one_line_error(res, "cuda", "CUDA device")


@pytest.mark.parametrize("args, needle", [
    (["--backend", "tpu"], "unknown backend 'tpu'"),
    (["--dtype", "float64"], "dtype"),
    (["--plugin-params", "{bad json"], "plugin_params"),
    (["--plugin-params", '{"plugin_type": "mtp", "num_speculative_tokens": 9}'], "num_speculative_tokens"),
    (["--num-blocks", "1"], "num_blocks"),
    (["--cache-block-size", "0"], "cache_block_size"),
    (["--threads", "0"], "cpu_threads"),
])
def test_bad_option_with_the_shipped_model_is_one_line(args, needle):
    _one_line_error(_run("generate", *args, "--prompt", "x", "--max-tokens", "2"), needle)


def test_bad_config_is_one_line(tmp_path):
    cfg = tmp_path / "config.json"
    model = {"modelWeightPath": str(SHIPPED_MODEL)}
    cfg.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [model]},
                                                 "ScheduleConfig": {"maxBatchSize": -3}}}))
    _one_line_error(_run("generate", "--config", str(cfg), "--prompt", "x"), "maxBatchSize")
    cfg.write_text("{not json")
    _one_line_error(_run("generate", "--config", str(cfg), "--prompt", "x"))


def test_bad_checkpoint_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _one_line_error(_run("generate", "--model", str(tmp_path), "--prompt", "x"))


def test_debug_shows_the_traceback():
    for extra_args, env in ((["--debug"], {}), ([], {"MINDSPEC_DEBUG": "1"})):
        res = _run("generate", *extra_args, "--backend", "tpu", "--prompt", "x", env=env)
        assert res.returncode != 0 and "Traceback" in res.stderr and "unknown backend 'tpu'" in res.stderr


def test_serve_on_a_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = _run("serve", "--port", str(port), "--management-port", str(port), "--metrics-port", str(port))
    _one_line_error(res, f"127.0.0.1:{port}", "ServerConfig.port")


def test_options_apply_to_the_shipped_model():
    # --plugin-params '' turns MTP off on the shipped model: --stats then has no speculation line.
    on = _run("generate", "--prompt", "def f(x):", "--max-tokens", "4", "--stats")
    off = _run("generate", "--prompt", "def f(x):", "--max-tokens", "4", "--stats", "--plugin-params", "")
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert "[spec]" in on.stderr and "[spec]" not in off.stderr
    assert on.stdout == off.stdout  # lossless: greedy output is the same with and without MTP


def test_help_configs_and_argument_errors_do_not_load_torch():
    """The command line module imports nothing that loads torch (its import alone took ~2-3 s),
    so --help, ``configs`` and argparse's errors answer at once."""
    probe = "import sys, mindspec.cli; print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
    assert _run("--help").returncode == 0
    bad = _run("generate", "--max-tokens", "many")
    assert bad.returncode == 2 and "--max-tokens" in bad.stderr


@pytest.mark.parametrize("args, needle", [
    (["--config", "{config}"], "maxBatchSize"),
    (["--top-p", "2"], "top_p"),
    (["--model", "{tmp}/absent"], "model directory"),
    (["--model", "{config}"], "not a directory"),
    (["--model", "{tmp}/absent.gguf"], "GGUF file"),
])
def test_config_and_sampling_errors_answer_before_torch_loads(tmp_path, args, needle):
    """`generate`'s one-line errors about its config, its model path or its sampling options come
    before the engine's modules (torch) load, which took 4-8 s."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{}]},
                                                 "ScheduleConfig": {"maxBatchSize": -3}}}))
    argv = ["generate", "--prompt", "x", *(a.format(config=cfg, tmp=tmp_path) for a in args)]
    probe = (f"import sys, mindspec.cli; rc = mindspec.cli.main({argv!r}); "
             "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEC_DEBUG"}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert res.stdout.strip() == "2 []", res.stdout + res.stderr
    assert res.stderr.startswith("mindspec: error: ") and needle in res.stderr and res.stderr.count("\n") == 1


def test_configs_lists_prints_and_copies_the_shipped_configs(tmp_path):
    configs = Path(__file__).resolve().parents[1] / "configs"
    listed = _run("configs")
    assert listed.returncode == 0 and listed.stdout.split() == sorted(p.stem for p in configs.glob("*.json"))
    shown = _run("configs", "config_cpu_no_mtp")
    assert shown.returncode == 0 and shown.stdout == (configs / "config_cpu_no_mtp.json").read_text()
    copied = _run("configs", "config", "--copy", str(tmp_path))
    assert copied.returncode == 0 and (tmp_path / "config.json").read_bytes() == (configs / "config.json").read_bytes()
    again = _run("configs", "config", "--copy", str(tmp_path))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "already exists" in again.stderr
    unknown = _run("configs", "no_such_config")
    assert unknown.returncode == 2 and "config_cpu_no_mtp" in unknown.stderr and unknown.stderr.count("\n") == 1


@pytest.mark.slow
def test_compile_gives_the_eager_text_and_caches_its_packages(model_dir, tmp_path):
    args = ("generate", "--model", str(model_dir), "--prompt", "def add(a, b):", "--max-tokens", "12", "--ignore-eos",
            "--dtype", "float32", "--num-blocks", "64")
    env = {"MINDSPEC_CACHE_DIR": str(tmp_path)}
    eager = _run(*args, env=env)
    compiled = _run(*args, "--compile", env=env)
    assert eager.returncode == 0 and compiled.returncode == 0, eager.stderr + compiled.stderr
    assert compiled.stdout == eager.stdout
    assert [p.name.split("-")[0] for p in (tmp_path / "steps").glob("*.pt2")] == ["decode"]  # one prompt: bucket 1


def test_serve_compile_sets_decode_graphs_on_the_config():
    from mindspec.cli import build_parser, with_decode_graphs
    from mindspec.service.server import resolve_config

    config = resolve_config(None)
    assert config.model.decode_graphs is None
    assert with_decode_graphs(config, True).model.decode_graphs is True
    assert with_decode_graphs(config, False).model.decode_graphs is False
    assert build_parser().parse_args(["serve", "--compile"]).decode_graphs is True
    assert build_parser().parse_args(["serve"]).decode_graphs is None


def test_serve_compile_workers_set_the_config():
    from mindspec.cli import build_parser, with_model_options
    from mindspec.config.defaults import default_config

    config = default_config()
    assert build_parser().parse_args(["serve", "--compile-workers", "3"]).compile_workers == 3
    assert build_parser().parse_args(["serve"]).compile_workers is None
    assert with_model_options(config, compile_workers=0).model.compile_workers == 0


def test_serve_rejects_negative_compile_workers():
    result = _run("serve", "--compile-workers", "-1")
    assert result.returncode != 0 and "--compile-workers: must be >= 0, got -1" in result.stderr
