"""RMSNorm and the fused residual-add + RMSNorm.

Numerics follow transformers' DeepSeek RMSNorm: statistics in float32, the normalised value cast
to the input dtype, then multiplied by the weight (one rounding, as torch's bf16 multiply).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mindspec.backends.cuda.launch import check_rows, num_warps_for, pow2, row_tile, unit_last_stride


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, res_rows_ptr, w_ptr, out_ptr, sum_ptr,
    num_rows, dim, stride_x, stride_res, stride_out, stride_sum, eps,
    HAS_RESIDUAL: tl.constexpr, GATHER_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # GATHER_RESIDUAL: row t adds the residual's row res_rows[t]
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    ok = (rows[:, None] < num_rows) & (cols[None, :] < dim)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    if HAS_RESIDUAL:
        if GATHER_RESIDUAL:
            res_rows = tl.load(res_rows_ptr + rows, mask=rows < num_rows, other=0).to(tl.int64)
        else:
            res_rows = rows64
        r = tl.load(res_ptr + res_rows[:, None] * stride_res + cols[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum is rounded like torch's x + r
        tl.store(sum_ptr + rows64[:, None] * stride_sum + cols[None, :], x, mask=ok)
    y = _normed(x, w_ptr, cols, dim, eps)
    tl.store(out_ptr + rows64[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _normed(x, w_ptr, cols, dim, eps):
    """x [BT, BD] (masked lanes 0) -> RMSNorm(x) * w in float32, the normalised value rounded to
    x's dtype first (as torch's bf16 multiply)."""
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / dim + eps)  # [BT]
    h = (xf * inv[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    return h * w[None, :]


@triton.jit
def _embed_norm_concat_kernel(
    ids_ptr, embed_ptr, hidden_ptr, enorm_ptr, hnorm_ptr, out_ptr,
    num_rows, dim, stride_embed, stride_hidden, stride_out, eps,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    row_ok = rows < num_rows
    ok = row_ok[:, None] & (cols[None, :] < dim)
    rows64 = rows.to(tl.int64)
    tokens = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # [BT]
    e = tl.load(embed_ptr + tokens[:, None] * stride_embed + cols[None, :], mask=ok, other=0.0)
    h = tl.load(hidden_ptr + rows64[:, None] * stride_hidden + cols[None, :], mask=ok, other=0.0)
    out = out_ptr + rows64[:, None] * stride_out + cols[None, :]
    tl.store(out, _normed(e, enorm_ptr, cols, dim, eps).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + dim, _normed(h, hnorm_ptr, cols, dim, eps).to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, residual, weight: torch.Tensor, eps: float, residual_rows=None):
    check_rows("rms_norm", x, 2)
    x = unit_last_stride(x)
    num_rows, dim = x.shape
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({dim},)")
    out = torch.empty((num_rows, dim), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = torch.empty_like(x) if residual is not None else out
    if residual is not None:
        residual = unit_last_stride(residual)
        rows = residual.shape if residual_rows is None else (residual_rows.shape[0], residual.shape[1])
        if tuple(rows) != tuple(x.shape):
            raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} (rows {rows[0]}) != x {tuple(x.shape)}")
    if num_rows == 0:
        return out, summed
    block_d = pow2(dim)
    block_t = row_tile(num_rows, dim)
    res = residual if residual is not None else x
    _rms_norm_kernel[(triton.cdiv(num_rows, block_t),)](
        x, res, res if residual_rows is None else residual_rows, weight, out, summed,
        num_rows, dim, x.stride(0), res.stride(0), out.stride(0), summed.stride(0), eps,
        HAS_RESIDUAL=residual is not None, GATHER_RESIDUAL=residual_rows is not None, BLOCK_T=block_t,
        BLOCK_D=block_d, num_warps=num_warps_for(block_d),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] -> RMSNorm(x) * weight."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual_rows: torch.Tensor | None = None):
    """-> (RMSNorm(x + residual) * weight, x + residual), one pass over the row; with
    ``residual_rows`` [T] the residual's rows gathered as they load (residual[residual_rows])."""
    return _launch(x, residual, weight, eps, residual_rows)


def embed_norm_concat(
    input_ids: torch.Tensor, embed: torch.Tensor, enorm: torch.Tensor, hidden: torch.Tensor, hnorm: torch.Tensor,
    eps: float,
):
    """input_ids [T], hidden [T, D] -> concat[RMSNorm(embed[ids]) * enorm, RMSNorm(hidden) * hnorm]
    [T, 2D] in one launch, or None where the two halves would differ in dtype (the caller then
    takes the separate ops)."""
    check_rows("embed_norm_concat", hidden, 2)
    num_rows, dim = hidden.shape
    dtype = torch.promote_types(enorm.dtype, embed.dtype)
    if dtype != torch.promote_types(hnorm.dtype, hidden.dtype):
        return None
    if embed.dim() != 2 or embed.shape[1] != dim or enorm.shape != (dim,) or hnorm.shape != (dim,):
        raise ValueError(f"embed_norm_concat: embed {tuple(embed.shape)}, enorm {tuple(enorm.shape)}, "
                         f"hnorm {tuple(hnorm.shape)} do not fit hidden [{num_rows}, {dim}]")
    if input_ids.shape != (num_rows,):
        raise ValueError(f"embed_norm_concat: input_ids {tuple(input_ids.shape)} != ({num_rows},)")
    out = torch.empty((num_rows, 2 * dim), dtype=dtype, device=hidden.device)
    if num_rows == 0:
        return out
    embed, hidden, input_ids = unit_last_stride(embed), unit_last_stride(hidden), input_ids.contiguous()
    block_d = pow2(dim)
    block_t = row_tile(num_rows, 2 * dim)
    _embed_norm_concat_kernel[(triton.cdiv(num_rows, block_t),)](
        input_ids, embed, hidden, enorm, hnorm, out,
        num_rows, dim, embed.stride(0), hidden.stride(0), out.stride(0), eps,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps_for(block_d),
    )
    return out
