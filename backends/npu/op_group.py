"""Shared state of the op groups: the torch_npu module, the composed fallback and its log."""
from __future__ import annotations

from types import ModuleType

from mindspec.backends.cpu.backend import CpuBackend

from .fallback import FallbackLog


class OpGroup:
    def __init__(self, npu: ModuleType, composed: CpuBackend, fallbacks: FallbackLog):
        self.npu = npu  # torch_npu (or its test-support reference)
        self.composed = composed  # pure-torch ops; they run on whatever device their inputs are on
        self.fallbacks = fallbacks
