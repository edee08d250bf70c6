"""Plain-formula references for the backend ops (test support only).

Written straight from the math with loops over sequences, heads and tokens, independent of any
backend code, so every backend (cpu included) is checked against these.
"""
from __future__ import annotations

import math

import torch


def rms_norm(x, weight, eps):
    xf = x.double()
    rms = torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return (weight.double() * (xf / rms).to(x.dtype).double())


def silu_and_mul(x):
    half = x.shape[-1] // 2
    a, b = x[..., :half].double(), x[..., half:].double()
    return a / (1 + torch.exp(-a)) * b


def rope(x, positions, inv_freq, attention_factor=1.0):
    """Rotate interleaved pairs as complex numbers: (x0 + i x1) * af * e^{i pos f_j}."""
    T, H, P = x.shape
    out = torch.empty(T, H, P, dtype=torch.float64)
    for t in range(T):
        for j in range(P // 2):
            ang = float(positions[t]) * float(inv_freq[j])
            rot = complex(math.cos(ang), math.sin(ang)) * attention_factor
            for h in range(H):
                z = complex(float(x[t, h, 2 * j]), float(x[t, h, 2 * j + 1])) * rot
                out[t, h, 2 * j], out[t, h, 2 * j + 1] = z.real, z.imag
    return out


def attention(q, k, v, scale, allowed):
    """Single-head attention: q [Q, D], k [K, D], v [K, Dv], allowed [Q, K] bool -> [Q, Dv] (float64)."""
    s = (q.double() @ k.double().T) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return p @ v.double()


def causal_end_mask(q_len, seq_len, tree=None):
    """[q_len, seq_len]: new token i sits at seq_len - q_len + i; tree [q_len, q_len] replaces the
    causal part among the new tokens."""
    ctx = seq_len - q_len
    m = torch.zeros(q_len, seq_len, dtype=torch.bool)
    for i in range(q_len):
        m[i, :ctx] = True
        for j in range(q_len):
            m[i, ctx + j] = bool(tree[i, j]) if tree is not None else j <= i
    return m


def expanded_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, mask):
    """Non-absorbed MLA of one sequence: per head, k = [c_kv @ W_UK[h]^T | k_pe], v = c_kv @ W_UV[h]^T.

    q_nope [Q, H, Dn], q_pe [Q, H, P], c_kv [S, R], k_pe [S, P], w_uk [H, Dn, R], w_uv [H, Dv, R]
    -> [Q, H, Dv] float64.
    """
    Q, H, _ = q_nope.shape
    out = torch.empty(Q, H, w_uv.shape[1], dtype=torch.float64)
    for h in range(H):
        k = torch.cat([c_kv.double() @ w_uk[h].double().T, k_pe.double()], dim=-1)
        v = c_kv.double() @ w_uv[h].double().T
        q = torch.cat([q_nope[:, h].double(), q_pe[:, h].double()], dim=-1)
        out[:, h] = attention(q, k, v, scale, mask)
    return out


def moe_experts(x, topk_weights, topk_ids, w13, w2):
    """Per token, per chosen expert: w * down(silu(gate x) * up x), summed (float64)."""
    T, k = topk_ids.shape
    inter = w2.shape[-1]
    out = torch.zeros(T, x.shape[-1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(topk_ids[t, j])
            xt = x[t].double()
            gate = w13[e, :inter].double() @ xt
            up = w13[e, inter:].double() @ xt
            h = w2[e].double() @ (gate / (1 + torch.exp(-gate)) * up)
            out[t] += float(topk_weights[t, j]) * h
    return out


def paged_metadata(seq_lens, q_lens, block_size, num_blocks, seed=0, skip_slots=(), tree_mask=None, is_prefill=False):
    """AttentionMetadata for ragged sequences over shuffled (non-contiguous) blocks.

    Sequence b holds seq_lens[b] tokens; its last q_lens[b] are the new ones. skip_slots lists flat
    new-token indices whose slot is -1. Unused block-table entries hold a large garbage value.
    Returns (meta, all_slots) where all_slots[b] is the list of slots of every token of sequence b.
    """
    from mindspec.backend import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    B = len(seq_lens)
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1
    tables = torch.full((B, max_blocks), 10**6, dtype=torch.int32)
    all_slots, new_slots = [], []
    for b, (s, q) in enumerate(zip(seq_lens, q_lens)):
        nb = -(-s // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(blocks, dtype=torch.int32)
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(s)]
        all_slots.append(slots)
        new_slots.extend(slots[s - q:])
    slots_t = torch.tensor(new_slots, dtype=torch.int64)
    for i in skip_slots:
        slots_t[i] = -1
    q_start = [0]
    for q in q_lens:
        q_start.append(q_start[-1] + q)
    meta = AttentionMetadata(
        slots=slots_t,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        q_lens=torch.tensor(q_lens, dtype=torch.int32),
        q_start_loc=torch.tensor(q_start, dtype=torch.int32),
        seq_lens_host=list(seq_lens),
        q_lens_host=list(q_lens),
        is_prefill=is_prefill,
        tree_mask=tree_mask,
    )
    return meta, all_slots
