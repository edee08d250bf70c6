"""Ascend NPU backend (torch_npu). Importing this package does not import torch_npu."""
from mindspec.backends.npu.backend import NpuBackend

__all__ = ["NpuBackend"]
