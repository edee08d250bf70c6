"""An MTP module's eh_proj with its input built as the GEMM loads it: one launch a draft stage.

The module projects concat[RMSNorm(embed[ids]) * enorm, RMSNorm(hidden) * hnorm] [T, 2D] to
[T, D] (``Backend.mtp_eh_proj``). As two kernels (norm.embed_norm_concat, then the skinny
GEMM) the concatenated rows go through memory between them; here each program of the skinny
GEMM (linear.py: 32 output columns a program, every row at once) first takes both halves' RMS
statistics of its rows, then normalises each chunk of the concatenated row as it loads it,
rounding as the separate kernels round (the normalised value to the model dtype, times the
weight, to the model dtype), so the output equals theirs. The first draft stage's hidden states,
rows of the drafter's hidden cache (``IndexedRows``), are gathered as they are loaded.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mindspec.backend import IndexedRows
from mindspec.backends.cuda import linear
from mindspec.backends.cuda.launch import dot_precision, unit_last_stride


@triton.jit
def _eh_proj_kernel(
    ids_ptr, embed_ptr, hidden_ptr, hidden_rows_ptr, enorm_ptr, hnorm_ptr, w_ptr, out_ptr, num_rows, n_out, dim,
    eps, stride_e, stride_h, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    GATHER_HIDDEN: tl.constexpr,
):
    # GATHER_HIDDEN: row m's hidden state is hidden's row hidden_rows[m]
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < num_rows
    n_ok = n < n_out
    tokens = tl.load(ids_ptr + m, mask=m_ok, other=0).to(tl.int64)
    e_rows = embed_ptr + tokens[:, None] * stride_e  # [M, 1]
    if GATHER_HIDDEN:
        src = tl.load(hidden_rows_ptr + m, mask=m_ok, other=0).to(tl.int64)
    else:
        src = m.to(tl.int64)
    h_rows = hidden_ptr + src[:, None] * stride_h  # [M, 1]
    kk = tl.arange(0, BLOCK_K)
    squares_e = tl.zeros([BLOCK_M], tl.float32)
    squares_h = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        k = k0 + kk
        ok = m_ok[:, None] & (k < dim)[None, :]
        e = tl.load(e_rows + k[None, :], mask=ok, other=0.0).to(tl.float32)
        h = tl.load(h_rows + k[None, :], mask=ok, other=0.0).to(tl.float32)
        squares_e += tl.sum(e * e, axis=1)
        squares_h += tl.sum(h * h, axis=1)
    inv_e = 1.0 / tl.sqrt(squares_e / dim + eps)
    inv_h = 1.0 / tl.sqrt(squares_h / dim + eps)
    dtype = hidden_ptr.dtype.element_ty
    w_rows = w_ptr + n[None, :].to(tl.int64) * stride_wn  # [1, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, 2 * dim, BLOCK_K):  # columns of the concatenated row [embedding half | hidden half]
        k = k0 + kk
        first = k < dim
        second = (k >= dim) & (k < 2 * dim)
        ke = tl.where(first, k, 0)
        kh = tl.where(second, k - dim, 0)
        e = tl.load(e_rows + ke[None, :], mask=m_ok[:, None] & first[None, :], other=0.0).to(tl.float32)
        h = tl.load(h_rows + kh[None, :], mask=m_ok[:, None] & second[None, :], other=0.0).to(tl.float32)
        ge = tl.load(enorm_ptr + ke, mask=first, other=0.0).to(tl.float32)
        gh = tl.load(hnorm_ptr + kh, mask=second, other=0.0).to(tl.float32)
        ne = ((e * inv_e[:, None]).to(dtype).to(tl.float32) * ge[None, :]).to(dtype)
        nh = ((h * inv_h[:, None]).to(dtype).to(tl.float32) * gh[None, :]).to(dtype)
        a = tl.where(first[None, :], ne, nh)
        w = tl.load(w_rows + k[:, None], mask=(k < 2 * dim)[:, None] & n_ok[None, :], other=0.0)  # [K, N]
        acc += tl.dot(a, w, input_precision=PRECISION)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


def fits(input_ids: torch.Tensor, embed, enorm: torch.Tensor, hidden: torch.Tensor | IndexedRows,
         hnorm: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``eh_proj`` takes this stage: the skinny GEMM's rows, widths and dtypes, every
    operand in the model dtype (otherwise the separate ops run)."""
    states = hidden.buffer if isinstance(hidden, IndexedRows) else hidden
    if not (linear.enabled() and isinstance(embed, torch.Tensor) and states.dim() == 2 and embed.dim() == 2
            and weight.dim() == 2):
        return False
    rows = hidden.rows.shape[0] if isinstance(hidden, IndexedRows) else states.shape[0]
    dim = states.shape[1]
    return (0 < rows <= linear.MAX_ROWS and states.dtype in linear.HALF_DTYPES
            and all(t.dtype == states.dtype for t in (embed, enorm, hnorm, weight))
            and input_ids.shape == (rows,) and embed.shape[1] == dim and enorm.shape == (dim,) and hnorm.shape == (dim,)
            and weight.shape[1] == 2 * dim <= linear.MAX_K and weight.stride(-1) == 1)


def eh_proj(input_ids: torch.Tensor, embed: torch.Tensor, enorm: torch.Tensor, hidden: torch.Tensor | IndexedRows,
            hnorm: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """input_ids [T], hidden [T, D] (or rows of a buffer), weight [D_out, 2D] -> [T, D_out]
    (``fits`` first)."""
    gather = isinstance(hidden, IndexedRows)
    states, hidden_rows = (hidden.buffer, hidden.rows) if gather else (hidden, input_ids)
    num_rows, dim = input_ids.shape[0], states.shape[1]
    n_out = weight.shape[0]
    out = torch.empty((num_rows, n_out), dtype=states.dtype, device=states.device)
    embed, states = unit_last_stride(embed), unit_last_stride(states)
    block_n, block_k = linear.tiles(n_out, 2 * dim)
    _eh_proj_kernel[(triton.cdiv(n_out, block_n),)](
        input_ids.contiguous(), embed, states, hidden_rows, enorm, hnorm, weight, out, num_rows, n_out, dim, eps,
        embed.stride(0), states.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=linear.MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(states.dtype),
        GATHER_HIDDEN=gather, num_warps=4,
    )
    return out
