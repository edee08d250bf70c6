"""DeepSeek rope: rotate interleaved pairs (x0, x1), (x2, x3), ... and keep the interleaved layout.

cos/sin rows come from the model's ``RotaryEmbedding.cos_sin_cache`` ([max_pos, P] float32,
[cos | sin], YaRN attention factor included), gathered by position inside the kernel. As in
transformers, cos/sin are cast to the activation dtype and each product is rounded to it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mindspec.backend import RotaryEmbedding
from mindspec.backends.cuda.launch import pow2, row_tile


@triton.jit
def rotate_pairs(x0, x1, cos, sin, dtype: tl.constexpr):
    """(x0 + i x1) * (cos + i sin) with torch's per-op rounding in ``dtype``; inputs float32."""
    c = cos.to(dtype).to(tl.float32)
    s = sin.to(dtype).to(tl.float32)
    a = (x0 * c).to(dtype).to(tl.float32)
    b = (x1 * s).to(dtype).to(tl.float32)
    d = (x0 * s).to(dtype).to(tl.float32)
    e = (x1 * c).to(dtype).to(tl.float32)
    return (a - b).to(dtype), (d + e).to(dtype)


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, pos_ptr, table_ptr,
    num_rows, heads, half, stride_xt, stride_xh, stride_ot, stride_oh, stride_table,
    BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # (token, head) pairs
    j = tl.arange(0, BLOCK_HALF)
    row_ok = rows < num_rows
    tok = (rows // heads).to(tl.int64)
    head = (rows % heads).to(tl.int64)
    ok = row_ok[:, None] & (j[None, :] < half)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int64)
    cos = tl.load(table_ptr + pos[:, None] * stride_table + j[None, :], mask=ok, other=0.0)
    sin = tl.load(table_ptr + pos[:, None] * stride_table + half + j[None, :], mask=ok, other=0.0)
    src = x_ptr + tok[:, None] * stride_xt + head[:, None] * stride_xh + 2 * j[None, :]
    x0 = tl.load(src, mask=ok, other=0.0)
    x1 = tl.load(src + 1, mask=ok, other=0.0)
    o0, o1 = rotate_pairs(x0.to(tl.float32), x1.to(tl.float32), cos, sin, out_ptr.dtype.element_ty)
    dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + 2 * j[None, :]
    tl.store(dst, o0, mask=ok)
    tl.store(dst + 1, o1, mask=ok)


def cos_sin_rows(positions: torch.Tensor, rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [*, P] float32 of [cos | sin] rows, row index per token [T]).

    With the model's cache the kernel gathers rows by position; without one the rows of these
    positions are computed here once (the same formula the cache was built with)."""
    if rotary.cos_sin_cache is not None and rotary.cos_sin_cache.device == positions.device:
        return rotary.cos_sin_cache, positions
    cos, sin = rotary.cos_sin(positions)
    table = torch.cat([cos, sin], dim=-1).to(device=positions.device, dtype=torch.float32).contiguous()
    return table, torch.arange(positions.shape[0], device=positions.device)


def rope(x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
    """x [T, H, P] (any row strides, unit last stride) -> roped copy [T, H, P]."""
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"rope: expected x [T, H, P] with even P, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, heads, rope_dim = x.shape
    if positions.shape != (num_tokens,):
        raise ValueError(f"rope: positions {tuple(positions.shape)} do not match {num_tokens} tokens")
    out = torch.empty((num_tokens, heads, rope_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    table, row_idx = cos_sin_rows(positions, rotary)
    half = rope_dim // 2
    if table.shape[-1] != rope_dim:
        raise ValueError(f"rope: cos/sin table has {table.shape[-1]} columns, x has rope dim {rope_dim}")
    num_rows = num_tokens * heads
    block_rows = row_tile(num_rows, rope_dim)
    _rope_kernel[(triton.cdiv(num_rows, block_rows),)](
        x, out, row_idx, table,
        num_rows, heads, half, x.stride(0), x.stride(1), out.stride(0), out.stride(1), table.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_HALF=pow2(half),
    )
    return out
