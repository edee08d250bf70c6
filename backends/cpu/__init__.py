from mindspec.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
