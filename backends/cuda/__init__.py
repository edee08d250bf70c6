"""The cuda backend: Triton kernels for every backend op, CUDA graphs for the decode step.

Importing this package imports neither triton nor the kernels: ``CudaBackend`` checks first that
triton and a CUDA device (or Triton's CPU interpreter) are there, so a missing piece is one clear
BackendError instead of an ImportError from deep inside.
"""
from mindspec.backends.cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
