"""The paged latent cache: store c_kv and k_pe of new tokens at their slots (slot -1 = skip), and
the fused latent step (RMSNorm of c_kv + rope of k_pe + cache write, one pass per token).

slot = block_id * block_size + offset. The cache tensors may be views into one buffer (the base
allocation keeps [c_kv | k_pe] rows together), so every address goes through the view's strides.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mindspec.backend import LatentCache, RotaryEmbedding
from mindspec.backends.cuda.launch import pow2, row_tile
from mindspec.backends.cuda.rope import cos_sin_rows, rotate_pairs


@triton.jit
def _cache_rows(slot_ptr, rows, num_rows, block_size, stride_blk, stride_row):
    """Element offset of each row's cache entry and whether to write it."""
    slot = tl.load(slot_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int64)
    keep = slot >= 0
    slot = tl.where(keep, slot, 0)
    return (slot // block_size) * stride_blk + (slot % block_size) * stride_row, keep


@triton.jit
def _write_latent_kernel(
    c_ptr, pe_ptr, slot_ptr, cache_c_ptr, cache_pe_ptr,
    num_rows, rank, rope_dim, block_size, stride_c, stride_pe,
    stride_cc_blk, stride_cc_row, stride_cp_blk, stride_cp_row,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    rows64 = rows.to(tl.int64)
    c_dst, keep = _cache_rows(slot_ptr, rows, num_rows, block_size, stride_cc_blk, stride_cc_row)
    pe_dst, _ = _cache_rows(slot_ptr, rows, num_rows, block_size, stride_cp_blk, stride_cp_row)
    ok_c = keep[:, None] & (r[None, :] < rank)
    ok_p = keep[:, None] & (p[None, :] < rope_dim)
    c = tl.load(c_ptr + rows64[:, None] * stride_c + r[None, :], mask=ok_c)
    pe = tl.load(pe_ptr + rows64[:, None] * stride_pe + p[None, :], mask=ok_p)
    tl.store(cache_c_ptr + c_dst[:, None] + r[None, :], c.to(cache_c_ptr.dtype.element_ty), mask=ok_c)
    tl.store(cache_pe_ptr + pe_dst[:, None] + p[None, :], pe.to(cache_pe_ptr.dtype.element_ty), mask=ok_p)


@triton.jit
def _latent_norm_rope_cache_kernel(
    kv_ptr, w_ptr, pos_ptr, table_ptr, slot_ptr, c_out_ptr, pe_out_ptr, cache_c_ptr, cache_pe_ptr,
    num_rows, rank, half, block_size, eps, stride_kv, stride_table, stride_c_out, stride_pe_out,
    stride_cc_blk, stride_cc_row, stride_cp_blk, stride_cp_row,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows64 = rows.to(tl.int64)
    row_ok = rows < num_rows
    r = tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_HALF)
    ok_r = row_ok[:, None] & (r[None, :] < rank)
    ok_j = row_ok[:, None] & (j[None, :] < half)

    # RMSNorm of the latent (float32 statistics, cast to the input dtype, times the weight).
    lat = tl.load(kv_ptr + rows64[:, None] * stride_kv + r[None, :], mask=ok_r, other=0.0)
    lf = lat.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(lf * lf, axis=1) / rank + eps)
    w = tl.load(w_ptr + r, mask=r < rank, other=0.0).to(tl.float32)
    c = ((lf * inv[:, None]).to(lat.dtype).to(tl.float32) * w[None, :]).to(c_out_ptr.dtype.element_ty)

    # Rope of the interleaved k_pe pairs that follow the latent in the same row.
    pos = tl.load(pos_ptr + rows64, mask=row_ok, other=0).to(tl.int64)
    cos = tl.load(table_ptr + pos[:, None] * stride_table + j[None, :], mask=ok_j, other=0.0)
    sin = tl.load(table_ptr + pos[:, None] * stride_table + half + j[None, :], mask=ok_j, other=0.0)
    src = kv_ptr + rows64[:, None] * stride_kv + rank + 2 * j[None, :]
    x0 = tl.load(src, mask=ok_j, other=0.0)
    x1 = tl.load(src + 1, mask=ok_j, other=0.0)
    o0, o1 = rotate_pairs(x0.to(tl.float32), x1.to(tl.float32), cos, sin, pe_out_ptr.dtype.element_ty)

    tl.store(c_out_ptr + rows64[:, None] * stride_c_out + r[None, :], c, mask=ok_r)
    pe_dst = pe_out_ptr + rows64[:, None] * stride_pe_out + 2 * j[None, :]
    tl.store(pe_dst, o0, mask=ok_j)
    tl.store(pe_dst + 1, o1, mask=ok_j)

    c_row, keep = _cache_rows(slot_ptr, rows, num_rows, block_size, stride_cc_blk, stride_cc_row)
    pe_row, _ = _cache_rows(slot_ptr, rows, num_rows, block_size, stride_cp_blk, stride_cp_row)
    tl.store(cache_c_ptr + c_row[:, None] + r[None, :], c.to(cache_c_ptr.dtype.element_ty), mask=ok_r & keep[:, None])
    cache_pe = cache_pe_ptr + pe_row[:, None] + 2 * j[None, :]
    tl.store(cache_pe, o0.to(cache_pe_ptr.dtype.element_ty), mask=ok_j & keep[:, None])
    tl.store(cache_pe + 1, o1.to(cache_pe_ptr.dtype.element_ty), mask=ok_j & keep[:, None])


def _check_cache(cache: LatentCache) -> None:
    for name, t in (("c_kv", cache.c_kv), ("k_pe", cache.k_pe)):
        if t.dim() != 3 or t.stride(-1) != 1:
            raise ValueError(f"latent cache {name} must be [num_blocks, block_size, dim] with unit last stride")


def _check_slots(slots: torch.Tensor, num_tokens: int) -> None:
    if slots.shape != (num_tokens,):
        raise ValueError(f"slots {tuple(slots.shape)} do not match {num_tokens} tokens")


def write_latent_cache(cache: LatentCache, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    """cache[slot] = (c_kv [T, R], k_pe [T, P]); slot -1 is skipped."""
    _check_cache(cache)
    c_kv = c_kv if c_kv.stride(-1) == 1 else c_kv.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    num_tokens, rank = c_kv.shape
    rope_dim = k_pe.shape[1]
    _check_slots(slots, num_tokens)
    if num_tokens == 0:
        return
    block_t = row_tile(num_tokens, rank + rope_dim)
    cc, cp = cache.c_kv, cache.k_pe
    _write_latent_kernel[(triton.cdiv(num_tokens, block_t),)](
        c_kv, k_pe, slots, cc, cp,
        num_tokens, rank, rope_dim, cache.block_size, c_kv.stride(0), k_pe.stride(0),
        cc.stride(0), cc.stride(1), cp.stride(0), cp.stride(1),
        BLOCK_T=block_t, BLOCK_R=pow2(rank), BLOCK_P=pow2(rope_dim),
    )


def latent_norm_rope_cache(
    kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
    rotary: RotaryEmbedding, cache: LatentCache, slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_a [T, R + P] -> (RMSNorm(kv_a[:, :R]) * w [T, R], rope(kv_a[:, R:]) [T, P]), both stored."""
    _check_cache(cache)
    kv_a = kv_a if kv_a.stride(-1) == 1 else kv_a.contiguous()
    num_tokens, width = kv_a.shape
    rank = norm_weight.shape[0]
    rope_dim = width - rank
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"latent_norm_rope_cache: kv_a width {width} minus rank {rank} must be a positive even rope dim")
    _check_slots(slots, num_tokens)
    c_out = torch.empty((num_tokens, rank), dtype=torch.promote_types(norm_weight.dtype, kv_a.dtype), device=kv_a.device)
    pe_out = torch.empty((num_tokens, rope_dim), dtype=kv_a.dtype, device=kv_a.device)
    if num_tokens == 0:
        return c_out, pe_out
    table, row_idx = cos_sin_rows(positions, rotary)
    block_t = row_tile(num_tokens, width)
    cc, cp = cache.c_kv, cache.k_pe
    _latent_norm_rope_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        kv_a, norm_weight, row_idx, table, slots, c_out, pe_out, cc, cp,
        num_tokens, rank, rope_dim // 2, cache.block_size, eps, kv_a.stride(0), table.stride(0),
        c_out.stride(0), pe_out.stride(0), cc.stride(0), cc.stride(1), cp.stride(0), cp.stride(1),
        BLOCK_T=block_t, BLOCK_R=pow2(rank), BLOCK_HALF=pow2(rope_dim // 2),
    )
    return c_out, pe_out
