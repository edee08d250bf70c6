"""SwiGLU: silu(x[:, :I]) * x[:, I:], rounded to the activation dtype after each op as torch does."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mindspec.backends.cuda.launch import check_rows, pow2, row_tile, unit_last_stride


@triton.jit
def _silu_f32(g):
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, num_rows, inter, stride_x, stride_out, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (rows[:, None] < num_rows) & (cols[None, :] < inter)
    base = x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
    gate = tl.load(base, mask=ok, other=0.0)
    up = tl.load(base + inter, mask=ok, other=0.0)
    act = _silu_f32(gate.to(tl.float32)).to(gate.dtype).to(tl.float32)
    out = (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], out, mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I]."""
    check_rows("silu_and_mul", x, 2)
    x = unit_last_stride(x)
    num_rows, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul: last dim must be even (gate | up), got {width}")
    inter = width // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block_i = min(pow2(inter), 1024)
    block_t = row_tile(num_rows, block_i)
    grid = (triton.cdiv(num_rows, block_t), triton.cdiv(inter, block_i))
    _silu_and_mul_kernel[grid](x, out, num_rows, inter, x.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK_I=block_i)
    return out
