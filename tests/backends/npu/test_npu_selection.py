"""Choosing the npu backend: one clear error without torch_npu/CANN, never importing torch_npu for
other backends, MindIE's aliases, device strings and the device services."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mindspec.backend import BackendError, backend_class, get_backend
from mindspec.backends.npu import NpuBackend
from mindspec.backends.npu.device import resolve_device


def _assert_install_hint(message: str) -> None:
    for part in ("torch_npu", "pip install 'mindspec[npu]'", "CANN", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"):
        assert part in message, (part, message)


@pytest.mark.parametrize("name", ["npu", "atb", "torch"])
def test_without_torch_npu_choosing_npu_is_one_clear_error(monkeypatch, name):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    assert backend_class(name) is NpuBackend  # MindIE's backendType names map here
    with pytest.raises(BackendError) as exc:
        get_backend(name)
    _assert_install_hint(str(exc.value))
    assert "No module named 'torch_npu'" in str(exc.value)


def test_torch_npu_without_cann_libraries_is_the_same_clear_error(monkeypatch, tmp_path):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('libascendcl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(BackendError) as exc:
        get_backend("npu")
    _assert_install_hint(str(exc.value))
    assert "libascendcl.so" in str(exc.value)


def test_mindspec_and_the_cpu_backend_never_import_torch_npu(tmp_path):
    """A torch_npu on the path that leaves a marker when imported: running mindspec on the cpu
    backend (and importing the npu backend's package) must not touch it; choosing npu does."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    code = textwrap.dedent(f"""
        import os, sys, torch
        import mindspec, mindspec.llm, mindspec.backends.npu
        from mindspec.backend import BackendError, get_backend
        be = get_backend("cpu")
        be.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
        be.top_k_top_p(torch.randn(2, 8), torch.tensor([2, 8]), torch.tensor([0.5, 1.0]))
        assert "torch_npu" not in sys.modules and not os.path.exists({str(marker)!r})
        try:
            get_backend("npu")
        except BackendError as e:
            assert "did not register torch.npu" in str(e), e
        assert os.path.exists({str(marker)!r})  # the sentinel works: choosing npu imports it
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_device_strings(monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5")
    assert resolve_device(None, True, 2, False).device == "npu:0"
    assert resolve_device("npu", True, 2, False).device == "npu:0"
    assert resolve_device("npu:1", True, 2, False).index == 1
    with pytest.raises(BackendError, match=r"npu:2 does not exist: 2 NPU\(s\) visible \(ASCEND_RT_VISIBLE_DEVICES='4,5'\)"):
        resolve_device("npu:2", True, 2, False)
    with pytest.raises(BackendError, match="not an NPU device string"):
        resolve_device("cuda:0", True, 2, False)
    with pytest.raises(BackendError, match="not an NPU device string"):
        resolve_device("npu:x", True, 2, False)
    with pytest.raises(BackendError, match="no NPU is visible"):
        resolve_device("npu:0", False, 0, False)
    with pytest.raises(BackendError, match="only accepted with the test-support reference"):
        resolve_device("cpu", True, 2, False)
    assert resolve_device("cpu", False, 0, True).index is None


def test_the_host_reference_reports_no_npu(npu_ref):
    with pytest.raises(BackendError, match="no NPU is visible"):
        get_backend("npu")  # default npu:0: the stand-in has no device
    assert not torch.npu.is_available() and torch.npu.device_count() == 0


def test_device_services(npu_backend, npu_ref):
    assert npu_backend.dist_backend == "hccl" and npu_backend.device == torch.device("cpu")
    torch.npu.memory = (123 << 20, 456 << 20)
    assert npu_backend.mem_get_info() == (123 << 20, 456 << 20)
    stream, event = npu_backend.new_stream(), npu_backend.new_event()
    with npu_backend.stream(stream):
        assert torch.npu.current_stream() is stream
        event.record(stream)
    assert torch.npu.current_stream() is not stream and event.query()
    npu_backend.synchronize()


def test_fallback_is_logged_once_per_reason(npu_backend, npu_ref, caplog):
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8)
    with caplog.at_level("WARNING", logger="mindspec.backends.npu"):
        for _ in range(3):
            npu_backend.rms_norm(x, w, 1e-6)
    assert len(caplog.records) == 1 and "rms_norm uses the composed torch path" in caplog.text
    assert sum(npu_backend.fallbacks.counts.values()) == 3
