import subprocess
import sys
import textwrap
import types

import pytest
import torch

import mindspec.backend as backend_mod
from mindspec.backend import Backend, BackendError, available_backends, backend_class, get_backend


def test_get_cpu_backend():
    be = get_backend("cpu")
    assert isinstance(be, Backend)
    assert be.name == "cpu" and be.device == torch.device("cpu") and be.dist_backend == "gloo"
    free, total = be.mem_get_info()
    assert 0 < free <= total


def test_auto_resolves_to_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert get_backend("auto").name == "cpu"


def test_unknown_backend_names_choices():
    with pytest.raises(BackendError) as exc:
        get_backend("tpu")
    msg = str(exc.value)
    assert "tpu" in msg
    for name in ("cpu", "cuda", "npu"):
        assert name in msg


def test_cpu_does_not_import_device_libraries():
    code = textwrap.dedent(
        """
        import sys
        from mindspec.backend import get_backend
        be = get_backend("cpu")
        be.rms_norm(__import__("torch").ones(2, 4), __import__("torch").ones(4), 1e-6)
        bad = [m for m in ("triton", "torch_npu") if m in sys.modules]
        assert not bad, bad
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


class _ToyBackend(backend_mod.Backend):
    name = "toy"

    def default_device(self):
        return "cpu"


def test_entry_point_backend(monkeypatch):
    toy_module = types.ModuleType("_mindspec_toy_backend")
    toy_module._ToyBackend = _ToyBackend
    monkeypatch.setitem(sys.modules, "_mindspec_toy_backend", toy_module)
    monkeypatch.setattr(backend_mod, "_entry_point_backends", lambda: {"toy": "_mindspec_toy_backend:_ToyBackend"})
    assert "toy" in available_backends()
    assert backend_class("toy") is _ToyBackend
    # built-in names win over entry points
    monkeypatch.setattr(backend_mod, "_entry_point_backends", lambda: {"cpu": "_mindspec_toy_backend:_ToyBackend"})
    assert backend_class("cpu").__name__ == "CpuBackend"
