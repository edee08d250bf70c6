"""Asking for the cuda backend where it cannot run is one clear BackendError naming what is missing."""
import subprocess
import sys
import textwrap

import pytest
import torch

from mindspec.backend import BackendError
from mindspec.backends.cuda.availability import Environment, choose_device

NO_GPU = Environment(triton_found=True, cuda_available=False, interpreting=False, torch_cuda_version=None)


@pytest.mark.parametrize("env,requested,match", [
    (NO_GPU, None, "needs a CUDA device"),
    (NO_GPU, "cuda", "CPU-only torch build"),
    (Environment(True, False, False, "12.4"), "cuda:0", "torch built for CUDA 12.4"),
    (NO_GPU, "cpu", "TRITON_INTERPRET=1"),
    (Environment(False, True, False, "12.4"), "cuda", "pip install 'mindspec\\[cuda\\]'"),
    (Environment(True, True, False, "12.4"), "meta", "CUDA devices"),
    (NO_GPU, "no-such-device", "cannot use device"),
])
def test_refusals(env, requested, match):
    with pytest.raises(BackendError, match=match):
        choose_device(requested, env)


@pytest.mark.parametrize("env,requested,expected", [
    (Environment(True, False, True, None), None, "cpu"),  # CI: the interpreter on CPU tensors
    (Environment(True, False, True, None), "cpu", "cpu"),
    (Environment(True, True, False, "12.4"), None, "cuda"),
    (Environment(True, True, False, "12.4"), "cuda:0", "cuda:0"),
])
def test_accepted(env, requested, expected):
    assert choose_device(requested, env) == torch.device(expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_get_backend_cuda_without_gpu_or_interpreter_is_one_clear_error():
    code = textwrap.dedent(
        """
        import sys
        from mindspec.backend import BackendError, get_backend
        try:
            get_backend("cuda")
        except BackendError as exc:
            print("BackendError:", exc)
            sys.exit(0)
        sys.exit("no error")
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("BackendError: the cuda backend needs a CUDA device")
    assert "Traceback" not in out.stderr


def test_get_backend_reports_missing_triton(monkeypatch):
    import importlib.util

    from mindspec.backend import get_backend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(BackendError, match="needs triton"):
        get_backend("cuda")
