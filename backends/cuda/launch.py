"""Launch helpers shared by the kernel files: block sizes, interpreter-aware tiling, dot precision.

Under Triton's interpreter every program instance runs as Python, so there the wrappers choose
few, large programs; on a GPU they choose tiles for occupancy. Numerics do not depend on the tiling.
"""
from __future__ import annotations

import torch
import triton

from mindspec.backends.cuda.availability import interpreting

# tl.dot needs every dimension >= 16 on a GPU; smaller head dims are padded with masked lanes.
MIN_DOT = 16


def pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(max(1, int(n))))


def dot_pow2(n: int) -> int:
    return pow2(n, MIN_DOT)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs would otherwise be multiplied in TF32 on Ampere and later; keep them exact."""
    return "ieee" if dtype == torch.float32 else "tf32"


def row_tile(num_rows: int, row_width: int) -> int:
    """Rows per program for row-wise kernels (norms, activations, cache writes)."""
    if interpreting():
        return pow2(min(num_rows, 64))
    return 1 if row_width >= 2048 else pow2(min(num_rows, 4096 // pow2(row_width)))


def num_warps_for(width: int) -> int:
    return 8 if width >= 4096 else 4 if width >= 1024 else 2 if width >= 256 else 1


def check_rows(name: str, x: torch.Tensor, ndim: int) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {tuple(x.shape)}")


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """Kernels address rows by stride but need contiguous elements within a row."""
    return x if x.stride(-1) == 1 else x.contiguous()
