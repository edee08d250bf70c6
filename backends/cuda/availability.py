"""Can the cuda backend run here? One clear BackendError naming what is missing, before any
kernel module (and triton) is imported."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

import torch

from mindspec.backend import BackendError

INSTALL_HINT = "pip install 'mindspec[cuda]' (triton>=3.0) on a machine with a CUDA build of torch"


@dataclass(frozen=True)
class Environment:
    """What the backend depends on, gathered once so the decision below is a pure function."""

    triton_found: bool
    cuda_available: bool
    interpreting: bool  # TRITON_INTERPRET=1: kernels run on CPU tensors (how CI tests them)
    torch_cuda_version: Optional[str]  # None for a CPU-only torch build


def interpreting() -> bool:
    """Triton reads TRITON_INTERPRET when a kernel is decorated; mirror its parsing."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes", "y")


def current_environment() -> Environment:
    return Environment(
        triton_found=importlib.util.find_spec("triton") is not None,
        cuda_available=torch.cuda.is_available(),
        interpreting=interpreting(),
        torch_cuda_version=torch.version.cuda,
    )


def choose_device(requested: Optional[str], env: Environment) -> torch.device:
    """The device the backend runs on, or one BackendError saying why it cannot run."""
    if not env.triton_found:
        raise BackendError(f"the cuda backend needs triton, which is not installed: {INSTALL_HINT}")
    if requested is None:
        requested = "cuda" if env.cuda_available or not env.interpreting else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise BackendError(f"the cuda backend cannot use device {requested!r}: {exc}") from None
    if device.type == "cpu":
        if not env.interpreting:
            raise BackendError(
                "the cuda backend runs on device 'cpu' only under Triton's interpreter (TRITON_INTERPRET=1, "
                "for tests); choose backend 'cpu' for CPU inference"
            )
        return device
    if device.type != "cuda":
        raise BackendError(f"the cuda backend runs on CUDA devices, not {requested!r}")
    if not env.cuda_available:
        build = "a CPU-only torch build" if env.torch_cuda_version is None else f"torch built for CUDA {env.torch_cuda_version}"
        raise BackendError(
            f"the cuda backend needs a CUDA device, and none is visible ({build}, torch.cuda.is_available() is False): "
            f"{INSTALL_HINT}, or choose backend 'cpu'"
        )
    return device
