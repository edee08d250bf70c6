"""Absorbed MLA over the paged latent cache, and the expanded-K/V prefill attention.

Decode (and MTP verification, and any continuation with cached context): per sequence the new
tokens are its last q_len of seq_len tokens; score = (q_lat . c_kv + q_pe . k_pe) * scale, values
are c_kv, causal aligned to the end of the sequence (or meta.tree_mask among the new tokens).
One program owns a tile of (new token, head) rows of one sequence and streams that sequence's cache
through its block table once for all of them: every key is loaded once per tile, not per head
and not per query token. Long contexts are split over programs (split-KV, flash-decoding) and the
partial results merged by log-sum-exp in a second kernel.

Graph safety: lengths are read from device tensors (seq_lens, q_lens, q_start_loc), loop bounds
come from them, block-table columns are clamped to the table width, and the grid depends only on
static shapes; host lists only choose tile sizes.

Softmax uses exp2 with log2(e) folded into the scale; probabilities are cast to the value dtype
before P.V (as the cpu reference casts them before its einsum); accumulation is float32.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mindspec.backend import AttentionMetadata, LatentCache, RotaryEmbedding
from mindspec.backends.cuda.availability import interpreting
from mindspec.backends.cuda.launch import dot_pow2, dot_precision, pow2
from mindspec.backends.cuda.rope import cos_sin_rows, rotate_pairs
from mindspec.backends.cuda.tiles import check_token_count, num_tile_programs, seq_block, tile_of

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 256


@triton.jit
def _mla_decode_kernel(
    q_ptr, qpe_ptr, cache_c_ptr, cache_pe_ptr, bt_ptr, seq_lens_ptr, q_lens_ptr, q_start_ptr,
    tree_ptr, out_ptr, part_ptr, lse_ptr, pos_ptr, table_ptr,
    num_seqs, heads, rank, rope_dim, block_size, bt_width, qk_scale,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_table,
    stride_cc_blk, stride_cc_row, stride_cp_blk, stride_cp_row, stride_bt,
    stride_tree_b, stride_tree_i, tree_q,
    stride_ot, stride_oh, stride_part_t, stride_part_h, stride_part_s, stride_lse_t, stride_lse_h,
    NUM_SPLITS: tl.constexpr, TQ: tl.constexpr, BH: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, HAS_TREE: tl.constexpr, PRECISION: tl.constexpr,
    SEQ_BLOCK: tl.constexpr, ROPE_Q: tl.constexpr,
):
    # ROPE_Q: q_pe is rotated here as it is loaded (its interleaved pairs by the [cos | sin] row
    # of each token's position, rounded as the rope kernel rounds them) instead of by a launch of its own.
    pid_s = tl.program_id(2)
    b, i0 = tile_of(q_lens_ptr, num_seqs, tl.program_id(0), TQ, SEQ_BLOCK)
    if b < 0:
        return
    q_len = tl.load(q_lens_ptr + b)
    seq_len = tl.load(seq_lens_ptr + b)
    tok0 = tl.load(q_start_ptr + b)
    ctx = seq_len - q_len  # cached tokens before the new ones

    m = tl.arange(0, TQ * BH)
    i = i0 + m // BH  # new-token index within the sequence   [M]
    h = tl.program_id(1) * BH + m % BH  # head                  [M]
    row_ok = (i < q_len) & (h < heads)
    tok = (tok0 + i).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h[:, None] * stride_qh + r[None, :],
                mask=row_ok[:, None] & (r[None, :] < rank), other=0.0)  # [M, R]
    if ROPE_Q:
        j = tl.arange(0, BLOCK_P // 2)  # pairs
        pair_ok = row_ok[:, None] & (j[None, :] < rope_dim // 2)
        row = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int64) * stride_table  # [M]
        cos = tl.load(table_ptr + row[:, None] + j[None, :], mask=pair_ok, other=0.0)
        sin = tl.load(table_ptr + row[:, None] + rope_dim // 2 + j[None, :], mask=pair_ok, other=0.0)
        src = qpe_ptr + tok[:, None] * stride_pt + h[:, None] * stride_ph + 2 * j[None, :]
        x0 = tl.load(src, mask=pair_ok, other=0.0).to(tl.float32)
        x1 = tl.load(src + 1, mask=pair_ok, other=0.0).to(tl.float32)
        o0, o1 = rotate_pairs(x0, x1, cos, sin, qpe_ptr.dtype.element_ty)
        qpe = tl.interleave(o0, o1)  # [M, P]
    else:
        qpe = tl.load(qpe_ptr + tok[:, None] * stride_pt + h[:, None] * stride_ph + p[None, :],
                      mask=row_ok[:, None] & (p[None, :] < rope_dim), other=0.0)  # [M, P]

    # This split's key range; causally, no row of the tile sees past the tile's last new token.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = pid_s * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    if not HAS_TREE:
        hi = tl.minimum(hi, ctx + tl.minimum(i0 + TQ, q_len))

    m_i = tl.full([TQ * BH], float("-inf"), tl.float32)
    l_i = tl.zeros([TQ * BH], tl.float32)
    acc = tl.zeros([TQ * BH, BLOCK_R], tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        k = start + n  # key positions [N]
        k_ok = k < hi
        col = tl.minimum(k // block_size, bt_width - 1)
        blk = tl.load(bt_row + col, mask=k_ok, other=0).to(tl.int64)
        off = (k % block_size).to(tl.int64)
        c = tl.load(cache_c_ptr + blk[:, None] * stride_cc_blk + off[:, None] * stride_cc_row + r[None, :],
                    mask=k_ok[:, None] & (r[None, :] < rank), other=0.0).to(q.dtype)  # [N, R]
        pe = tl.load(cache_pe_ptr + blk[:, None] * stride_cp_blk + off[:, None] * stride_cp_row + p[None, :],
                     mask=k_ok[:, None] & (p[None, :] < rope_dim), other=0.0).to(qpe.dtype)  # [N, P]
        s = tl.dot(q, tl.trans(c), input_precision=PRECISION)
        s += tl.dot(qpe, tl.trans(pe), input_precision=PRECISION)
        s = s * qk_scale  # [M, N], log2 units
        if HAS_TREE:
            j = k[None, :] - ctx
            in_tree = row_ok[:, None] & k_ok[None, :] & (j >= 0) & (j < tree_q)
            t = tl.load(tree_ptr + b.to(tl.int64) * stride_tree_b + i[:, None] * stride_tree_i + j,
                        mask=in_tree, other=0)
            allowed = k_ok[None, :] & ((k[None, :] < ctx) | (t != 0))
        else:
            allowed = k_ok[None, :] & (k[None, :] <= ctx + i[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        alpha = tl.exp2(m_i - m_safe)
        prob = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c, input_precision=PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    ok = row_ok[:, None] & (r[None, :] < rank)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok[:, None] * stride_ot + h[:, None] * stride_oh + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + tok[:, None] * stride_part_t + h[:, None] * stride_part_h + pid_s * stride_part_s + r[None, :],
                 out, mask=ok)
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + tok * stride_lse_t + h * stride_lse_h + pid_s, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, heads, rank,
    stride_part_t, stride_part_h, stride_part_s, stride_lse_t, stride_lse_h, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BH: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    r = tl.arange(0, BLOCK_R)
    sp = tl.arange(0, BLOCK_S)
    h_ok = h < heads
    lse = tl.load(lse_ptr + t * stride_lse_t + h[:, None] * stride_lse_h + sp[None, :],
                  mask=h_ok[:, None] & (sp[None, :] < NUM_SPLITS), other=float("-inf"))  # [BH, S]
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top[:, None])  # empty splits weigh 0
    denom = tl.sum(weight, 1)
    acc = tl.zeros([BH, BLOCK_R], tl.float32)
    ok = h_ok[:, None] & (r[None, :] < rank)
    for s in tl.static_range(NUM_SPLITS):
        w_s = tl.sum(tl.where(sp[None, :] == s, weight, 0.0), 1)
        part = tl.load(part_ptr + t * stride_part_t + h[:, None] * stride_part_h + s * stride_part_s + r[None, :],
                       mask=ok, other=0.0)
        acc += w_s[:, None] * part
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + r[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def _decode_tiling(max_q: int, heads: int) -> tuple[int, int]:
    """(new tokens, heads) per program; rows = their product, at least 16 for tl.dot."""
    if interpreting():
        tq = pow2(max_q)
        return tq, max(pow2(heads), 16 // tq)
    tq = min(pow2(max_q), 16)
    return tq, max(1, 16 // tq)


def choose_num_splits(num_programs: int, max_keys: int, device: torch.device) -> int:
    """Split the keys only when the (tile, head block) programs cannot fill the GPU. Depends on static
    shapes only (program count, block-table width), so a captured graph keeps a valid choice."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if num_programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, num_programs), triton.cdiv(max_keys, MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def _tree_bytes(meta: AttentionMetadata) -> Optional[torch.Tensor]:
    if meta.tree_mask is None:
        return None
    key = "cuda.tree_mask_u8"
    tree = meta.scratch.get(key)
    if tree is None:
        tree = meta.tree_mask.to(device=meta.q_lens.device, dtype=torch.uint8).contiguous()
        meta.scratch[key] = tree
    return tree


def mla_decode(
    q_lat: torch.Tensor,  # [T, H, R]
    q_pe: torch.Tensor,  # [T, H, P]
    cache: LatentCache,
    meta: AttentionMetadata,
    scale: float,
    num_splits: Optional[int] = None,  # None: chosen from the device; tests force > 1
    rope_q: Optional[tuple[torch.Tensor, RotaryEmbedding]] = None,  # (positions [T], rotary): q_pe not yet roped
) -> torch.Tensor:
    """-> o_lat [T, H, R] in q_lat's dtype; with ``rope_q`` q_pe is rotated inside the kernel."""
    num_tokens, heads, rank = q_lat.shape
    rope_dim = q_pe.shape[-1]
    out = torch.empty_like(q_lat, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    check_token_count("mla_attention", meta, num_tokens)
    if cache.c_kv.shape[-1] != rank or cache.k_pe.shape[-1] != rope_dim:
        raise ValueError(f"mla_attention: cache dims ({cache.c_kv.shape[-1]}, {cache.k_pe.shape[-1]}) != q dims ({rank}, {rope_dim})")
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    tq, bh = _decode_tiling(meta.max_q_len or 1, heads)
    num_seqs = meta.q_lens.shape[0]
    programs = num_tile_programs(num_tokens, num_seqs, tq)
    head_blocks = triton.cdiv(heads, bh)
    tables = meta.block_tables
    if num_splits is None:
        num_splits = choose_num_splits(programs * head_blocks, tables.shape[1] * cache.block_size, q_lat.device)
    tree = _tree_bytes(meta)
    if num_splits > 1:
        part = torch.empty((num_tokens, heads, num_splits, rank), dtype=torch.float32, device=q_lat.device)
        lse = torch.empty((num_tokens, heads, num_splits), dtype=torch.float32, device=q_lat.device)
    else:
        part, lse = out, out  # unused
    tree_arg = tree if tree is not None else meta.q_lens
    if rope_q is None:
        table, rows = q_pe, meta.q_lens  # unused
    else:
        table, rows = cos_sin_rows(*rope_q)
        if table.shape[-1] != rope_dim or rope_dim % 2 or rows.shape != (num_tokens,):
            raise ValueError(f"mla_attention: rope table {tuple(table.shape)} / positions {tuple(rope_q[0].shape)} "
                             f"do not fit q_pe {tuple(q_pe.shape)}")
    interp = interpreting()
    _mla_decode_kernel[(programs, head_blocks, num_splits)](
        q_lat, q_pe, cache.c_kv, cache.k_pe, tables, meta.seq_lens, meta.q_lens, meta.q_start_loc,
        tree_arg, out, part, lse, rows, table,
        num_seqs, heads, rank, rope_dim, cache.block_size, tables.shape[1], scale * LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), table.stride(0),
        cache.c_kv.stride(0), cache.c_kv.stride(1), cache.k_pe.stride(0), cache.k_pe.stride(1), tables.stride(0),
        tree.stride(0) if tree is not None else 0, tree.stride(1) if tree is not None else 0,
        tree.shape[-1] if tree is not None else 0,
        out.stride(0), out.stride(1),
        part.stride(0) if num_splits > 1 else 0, part.stride(1) if num_splits > 1 else 0,
        part.stride(2) if num_splits > 1 else 0, lse.stride(0) if num_splits > 1 else 0,
        lse.stride(1) if num_splits > 1 else 0,
        NUM_SPLITS=num_splits, TQ=tq, BH=bh, BLOCK_N=64 if interp else 32,
        BLOCK_R=dot_pow2(rank), BLOCK_P=dot_pow2(rope_dim), HAS_TREE=tree is not None,
        PRECISION=dot_precision(q_lat.dtype), SEQ_BLOCK=seq_block(num_seqs), ROPE_Q=rope_q is not None,
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        merge_bh = pow2(heads) if interp else min(pow2(heads), 16)
        _merge_splits_kernel[(num_tokens, triton.cdiv(heads, merge_bh))](
            part, lse, out, heads, rank,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BH=merge_bh, BLOCK_S=pow2(num_splits), BLOCK_R=pow2(rank),
        )
    return out


@triton.jit
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, out_ptr, q_lens_ptr, q_start_ptr,
    num_seqs, dn, dp, dv, qk_scale,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_knt, stride_knh, stride_kpt,
    stride_vt, stride_vh, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DP: tl.constexpr,
    BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, SEQ_BLOCK: tl.constexpr,
):
    b, i0 = tile_of(q_lens_ptr, num_seqs, tl.program_id(0), BLOCK_M, SEQ_BLOCK)
    if b < 0:
        return
    h = tl.program_id(1).to(tl.int64)
    q_len = tl.load(q_lens_ptr + b)
    tok0 = tl.load(q_start_ptr + b).to(tl.int64)
    i = i0 + tl.arange(0, BLOCK_M)
    row_ok = i < q_len
    tok = tok0 + i
    dn_i = tl.arange(0, BLOCK_DN)
    dp_i = tl.arange(0, BLOCK_DP)
    dv_i = tl.arange(0, BLOCK_DV)
    qn = tl.load(qn_ptr + tok[:, None] * stride_qnt + h * stride_qnh + dn_i[None, :],
                 mask=row_ok[:, None] & (dn_i[None, :] < dn), other=0.0)
    qp = tl.load(qp_ptr + tok[:, None] * stride_qpt + h * stride_qph + dp_i[None, :],
                 mask=row_ok[:, None] & (dp_i[None, :] < dp), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = tl.minimum(q_len, i0 + BLOCK_M)  # causal: keys past the tile's last query are never needed
    n = tl.arange(0, BLOCK_N)
    for start in range(0, hi, BLOCK_N):
        j = start + n
        j_ok = j < hi
        kt = tok0 + j
        kn = tl.load(kn_ptr + kt[:, None] * stride_knt + h * stride_knh + dn_i[None, :],
                     mask=j_ok[:, None] & (dn_i[None, :] < dn), other=0.0)
        kp = tl.load(kp_ptr + kt[:, None] * stride_kpt + dp_i[None, :], mask=j_ok[:, None] & (dp_i[None, :] < dp), other=0.0)
        v = tl.load(v_ptr + kt[:, None] * stride_vt + h * stride_vh + dv_i[None, :],
                    mask=j_ok[:, None] & (dv_i[None, :] < dv), other=0.0)
        s = tl.dot(qn, tl.trans(kn), input_precision=PRECISION)
        s += tl.dot(qp, tl.trans(kp), input_precision=PRECISION)
        s = s * qk_scale
        s = tl.where(j_ok[None, :] & (j[None, :] <= i[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        prob = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + dv_i[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dv_i[None, :] < dv))


def mla_prefill(
    q_nope: torch.Tensor,  # [T, H, Dn]
    q_pe: torch.Tensor,  # [T, H, P]
    k_nope: torch.Tensor,  # [T, H, Dn]
    k_pe: torch.Tensor,  # [T, P]
    v: torch.Tensor,  # [T, H, Dv]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each sequence's new tokens (no cached context) -> [T, H, Dv]."""
    num_tokens, heads, dn = q_nope.shape
    dp, dv = q_pe.shape[-1], v.shape[-1]
    out = torch.empty((num_tokens, heads, dv), dtype=v.dtype, device=v.device)
    if num_tokens == 0:
        return out
    check_token_count("mla_prefill", meta, num_tokens)
    q_nope, q_pe, k_nope, k_pe, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_nope, q_pe, k_nope, k_pe, v))
    interp = interpreting()
    block_m = min(pow2(meta.max_q_len or 1, 16), 64)
    num_seqs = meta.q_lens.shape[0]
    _mla_prefill_kernel[(num_tile_programs(num_tokens, num_seqs, block_m), heads)](
        q_nope, q_pe, k_nope, k_pe, v, out, meta.q_lens, meta.q_start_loc,
        num_seqs, dn, dp, dv, scale * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=64 if interp else 32, BLOCK_DN=dot_pow2(dn), BLOCK_DP=dot_pow2(dp),
        BLOCK_DV=dot_pow2(dv), PRECISION=dot_precision(q_nope.dtype), SEQ_BLOCK=seq_block(num_seqs),
        num_warps=4, num_stages=2,
    )
    return out


