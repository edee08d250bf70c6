"""The one place that imports torch_npu, and only when the npu backend is chosen.

torch_npu is an optional extra: it needs Huawei's CANN libraries to import at all, and once
installed it hooks into ``import torch`` through torch's device-backend autoload entry point. So
nothing else in mindspec imports it, and a missing or broken install becomes one BackendError that
says what to install.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

from mindspec.backend import BackendError

INSTALL_HINT = (
    "the npu backend needs torch_npu (Ascend Extension for PyTorch, matching your torch version) and "
    "Huawei's CANN toolkit: `pip install 'mindspec[npu]'`, install CANN and `source "
    "<cann>/set_env.sh` so its libraries are found. Note: once torch_npu is installed, `import torch` "
    "loads it for every backend unless TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set."
)


def load_torch_npu() -> ModuleType:
    """Import torch_npu (which also registers ``torch.npu``) or raise one clear BackendError."""
    try:
        module = sys.modules.get("torch_npu") or importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or OSError/RuntimeError when CANN libraries are missing
        raise BackendError(f"{INSTALL_HINT} (import torch_npu failed: {type(exc).__name__}: {exc})") from exc
    if module is None:  # sys.modules["torch_npu"] = None blocks the import on purpose
        raise BackendError(f"{INSTALL_HINT} (torch_npu is blocked in sys.modules)")
    import torch

    if not hasattr(torch, "npu"):
        raise BackendError(f"{INSTALL_HINT} (torch_npu imported but did not register torch.npu)")
    return module
