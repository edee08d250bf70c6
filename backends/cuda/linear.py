"""Skinny linear: x [M, K] @ w [N, K].T for the few rows of a decode or verification step.

At M <= 16 a projection is a read of its weight plus a launch, and the launch dominates at small
widths. This kernel is one launch per projection: each program owns a slice of 32 output columns,
streams their weight rows once over K and multiplies every row of x (padded to 16 for ``tl.dot``).

Where it is used (``fits``), from graph-replayed timings on an H200 (benchmarks/README.md):
- bfloat16/float16 with K <= 1024: 1.7-2.7 us against cuBLAS's 2.4-3.3 us at the shipped model's
  and V2-Lite's narrower projections; at K >= 1408 cuBLAS is as fast or faster (5.1 vs 5.5 us);
- not float32: an exact-precision (``ieee``) tl.dot runs on the CUDA cores and took 6-74 us
  against cuBLAS's 2-16 us, so float32 stays with cuBLAS.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from mindspec.backends.cuda.activation import _silu_f32
from mindspec.backends.cuda.availability import interpreting
from mindspec.backends.cuda.launch import MIN_DOT, dot_precision, pow2

MAX_ROWS = MIN_DOT  # rows of x one launch multiplies: decode and verification steps
MAX_K = 1024  # longer rows: cuBLAS's split-K keeps more SMs streaming
ENV_SWITCH = "MINDSPEC_CUDA_SKINNY_LINEAR"  # "0": every projection through torch (cuBLAS)
HALF_DTYPES = (torch.float16, torch.bfloat16)  # routed here by ``fits``; float32 works but is slower


@triton.jit
def _skinny_linear_kernel(
    x_ptr, rows_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, sum_ptr, num_rows, num_x_rows, n_out, k_in, eps,
    stride_xm, stride_wn, stride_om, stride_rm, stride_sm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    SWIGLU: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
):
    # SWIGLU: w holds [gate | up] (2 * n_out rows); out = silu(x @ gate.T) * (x @ up.T), each
    # product and the activation rounded to x's dtype first, as the separate ops round them.
    # GATHER: output row m multiplies x's row rows[m]. A float32 out holds the product rounded
    # to x's dtype (the value `linear(x, w).float()` gives).
    # NORM: x's rows are RMS-normalised first, each program over the whole row (K <= MAX_K), and
    # rounded as the norm kernel rounds them: x * rsqrt(mean(x^2) + eps) to x's dtype, times
    # norm_ptr's weight, to x's dtype.
    # ADD: x's rows are x + residual first, rounded to x's dtype as torch's add rounds them;
    # program 0 also writes that sum for all num_x_rows rows of x to sum_ptr (the residual
    # stream's next value, gathered rows or not).
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < num_rows
    n_ok = n < n_out
    kk = tl.arange(0, BLOCK_K)
    if ADD:
        if pid == 0:
            for t0 in range(0, num_x_rows, BLOCK_M):
                t = (t0 + m).to(tl.int64)
                for k0 in range(0, k_in, BLOCK_K):
                    k = k0 + kk
                    ok = (t < num_x_rows)[:, None] & (k < k_in)[None, :]
                    a = _row_chunk(x_ptr, res_ptr, t, k, ok, stride_xm, stride_rm, ADD)
                    tl.store(sum_ptr + t[:, None] * stride_sm + k[None, :], a, mask=ok)
    if GATHER:
        src = tl.load(rows_ptr + m, mask=m_ok, other=0).to(tl.int64)  # [M] rows of x
    else:
        src = m.to(tl.int64)
    w_rows = w_ptr + n[None, :].to(tl.int64) * stride_wn  # [1, N]
    up_rows = w_ptr + (n[None, :] + n_out).to(tl.int64) * stride_wn  # [1, N] (SWIGLU only)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    inv = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        squares = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            k = k0 + kk
            ok = m_ok[:, None] & (k < k_in)[None, :]
            a = _row_chunk(x_ptr, res_ptr, src, k, ok, stride_xm, stride_rm, ADD).to(tl.float32)
            squares += tl.sum(a * a, axis=1)
        inv = 1.0 / tl.sqrt(squares / k_in + eps)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + kk
        k_ok = k < k_in
        a = _row_chunk(x_ptr, res_ptr, src, k, m_ok[:, None] & k_ok[None, :], stride_xm, stride_rm, ADD)
        if NORM:
            g = tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            h = (a.to(tl.float32) * inv[:, None]).to(a.dtype).to(tl.float32)
            a = (h * g[None, :]).to(a.dtype)
        w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [K, N]
        acc += tl.dot(a, w, input_precision=PRECISION)
        if SWIGLU:
            u = tl.load(up_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [K, N]
            acc_up += tl.dot(a, u, input_precision=PRECISION)
    dtype = x_ptr.dtype.element_ty  # the product's rounding, even where out is float32 (logits)
    if SWIGLU:
        act = _silu_f32(acc.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    out = acc.to(dtype).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _row_chunk(x_ptr, res_ptr, rows, k, ok, stride_xm, stride_rm, ADD: tl.constexpr):
    """x[rows, k] [M, K] (masked lanes 0), plus residual[rows, k] rounded to x's dtype with ADD."""
    a = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=ok, other=0.0)
    if ADD:
        r = tl.load(res_ptr + rows[:, None] * stride_rm + k[None, :], mask=ok, other=0.0)
        a = (a.to(tl.float32) + r.to(tl.float32)).to(a.dtype)
    return a


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def fits(x: torch.Tensor, weight: torch.Tensor, num_rows: Optional[int] = None) -> bool:
    """Whether ``skinny_linear`` takes this product (otherwise torch does); ``num_rows``: of the
    output where rows of x are gathered."""
    rows = x.numel() // max(x.shape[-1], 1) if num_rows is None else num_rows
    return (0 < rows <= MAX_ROWS and weight.dim() == 2 and weight.shape[1] <= MAX_K
            and x.dtype == weight.dtype and x.dtype in HALF_DTYPES and weight.stride(-1) == 1
            and x.shape[-1] == weight.shape[1])


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T: the skinny kernel where it fits, torch otherwise."""
    if enabled() and fits(x, weight):
        return skinny_linear(x, weight)
    return torch.nn.functional.linear(x, weight)


def fits_gathered(x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear`` takes x[rows] @ weight.T, gathering x's rows itself."""
    return enabled() and x.dim() == 2 and rows.dim() == 1 and fits(x, weight, rows.shape[0])


def fits_normed(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                rows: Optional[torch.Tensor] = None) -> bool:
    """Whether ``skinny_linear`` takes RMSNorm(x) * norm_weight @ weight.T (of x's ``rows``
    alone), normalising x itself."""
    fits_x = (enabled() and x.dim() == 2 and fits(x, weight)) if rows is None else fits_gathered(x, rows, weight)
    return fits_x and norm_weight.shape == (x.shape[1],) and norm_weight.dtype == x.dtype


def fits_add_normed(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                    rows: Optional[torch.Tensor] = None) -> bool:
    """Whether ``add_norm_linear`` takes RMSNorm(x + residual) * norm_weight @ weight.T (of x's
    ``rows`` alone)."""
    return (fits_normed(x, norm_weight, weight, rows) and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.stride(-1) == 1)


def fits_swiglu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear`` takes silu_and_mul(x @ weight.T) for weight [gate | up]."""
    return enabled() and fits(x, weight) and weight.shape[0] % 2 == 0


def tiles(n_out: int, k_in: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): on a GPU 32 columns per program (many programs for the SMs); under the
    interpreter few, large programs."""
    if interpreting():
        return min(pow2(n_out, MIN_DOT), 1024), min(pow2(k_in, MIN_DOT), 512)
    return 32, 128


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False,
                  rows: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                  norm: Optional[tuple[torch.Tensor, float]] = None,
                  add: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight [N, K].T -> [..., N] in x's dtype; with
    ``swiglu`` weight is [gate | up] [2N, K] and the output silu(gate) * up [..., N]; with
    ``rows`` [R <= MAX_ROWS] (x 2-d, any number of rows) x[rows] @ weight.T -> [R, N]; with
    ``out_dtype`` (float32) the result rounded to x's dtype, then widened; with ``norm``
    (weight [K], eps) RMSNorm(x) * weight takes x's place; with ``add`` (residual, summed: x's
    shape, x 2-d) x + residual takes x's place, and is written to summed (every row of x)."""
    lead = x.shape[:-1] if rows is None else rows.shape
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    k_in = x2.shape[1]
    num_rows = x2.shape[0] if rows is None else rows.shape[0]
    n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty((num_rows, n_out), dtype=out_dtype or x.dtype, device=x.device)
    block_n, block_k = tiles(n_out, k_in)
    norm_weight, eps = (x2, 0.0) if norm is None else norm
    residual, summed = (x2, x2) if add is None else add
    _skinny_linear_kernel[(triton.cdiv(n_out, block_n),)](
        x2, x2 if rows is None else rows, weight, out, norm_weight, residual, summed, num_rows, x2.shape[0], n_out,
        k_in, eps, x2.stride(0), weight.stride(0), out.stride(0), residual.stride(0), summed.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype), SWIGLU=swiglu,
        GATHER=rows is not None, NORM=norm is not None, ADD=add is not None, num_warps=4,
    )
    return out.view(*lead, n_out)


def add_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, rows: Optional[torch.Tensor] = None,
                    out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * norm_weight @ weight.T (of ``rows`` alone, as ``skinny_linear``'s),
    x + residual) in one launch (``fits_add_normed`` first)."""
    summed = torch.empty_like(x)
    out = skinny_linear(x, weight, rows=rows, out_dtype=out_dtype, norm=(norm_weight, eps), add=(residual, summed))
    return out, summed
