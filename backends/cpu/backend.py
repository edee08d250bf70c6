"""The cpu backend: the pure-torch reference every other backend is tested against.

Every op is vectorised over tokens and heads. Attention gathers each sequence's cache rows through
its block table into a padded [B, max_seq_len, ...] layout and masks (causal aligned to the end of
each sequence, or the tree mask among the new tokens); softmax runs in float32.
Numerics follow transformers' DeepSeek-V2/V3 eager code (RMSNorm and routers in fp32, cos/sin cast
to the activation dtype, expert outputs weighted in fp32 and cast back before the sum).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from mindspec.backend import (
    AttentionMetadata,
    Backend,
    ExpertWeights,
    LatentCache,
    RotaryEmbedding,
    RouterConfig,
)


def _token_layout(meta: AttentionMetadata, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index [T], index among that sequence's new tokens [T]) for the flat token batch."""
    q_lens = torch.as_tensor(meta.q_lens_host, dtype=torch.int64, device=device)
    seq_of_tok = torch.repeat_interleave(torch.arange(len(meta.q_lens_host), device=device), q_lens)
    if seq_of_tok.numel() != num_tokens:
        raise ValueError(f"metadata describes {seq_of_tok.numel()} new tokens, got {num_tokens}")
    starts = meta.q_start_loc.to(device=device, dtype=torch.int64)
    pos_in_seq = torch.arange(num_tokens, device=device) - starts[seq_of_tok]
    return seq_of_tok, pos_in_seq


def _pad(x: torch.Tensor, seq_of_tok: torch.Tensor, pos_in_seq: torch.Tensor, num_seqs: int, max_q: int) -> torch.Tensor:
    """Flat token-major [T, ...] -> padded [B, max_q, ...] (padding rows are zero)."""
    out = x.new_zeros((num_seqs, max_q) + tuple(x.shape[1:]))
    out[seq_of_tok, pos_in_seq] = x
    return out


def _softmax_pv(scores: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor, out_dtype: torch.dtype, eq: str) -> torch.Tensor:
    """Masked softmax in float32, cast to the activation dtype (as HF eager), then P.V."""
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(out_dtype)
    return torch.einsum(eq, probs, values)


class CpuBackend(Backend):
    name = "cpu"
    dist_backend = "gloo"

    def default_device(self) -> str:
        return "cpu"

    def mem_get_info(self) -> tuple[int, int]:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            return super().mem_get_info()

    # ---- cache ---------------------------------------------------------------------------
    def write_latent_cache(
        self, cache: LatentCache, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor
    ) -> None:
        slots = slots.to(device=cache.c_kv.device, dtype=torch.int64)
        keep = slots >= 0
        slots = slots[keep]
        block, offset = slots // cache.block_size, slots % cache.block_size
        # Indexed assignment on the (possibly strided) views writes into their storage.
        cache.c_kv[block, offset] = c_kv[keep].to(cache.c_kv.dtype)
        cache.k_pe[block, offset] = k_pe[keep].to(cache.k_pe.dtype)

    # ---- norms and activations -------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(input_dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]

    # ---- rope ----------------------------------------------------------------------------
    def rope(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        cos, sin = rotary.cos_sin(positions.to(x.device))  # [T, P/2] float32 each
        cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return out.flatten(-2)

    # ---- attention -------------------------------------------------------------------------
    def mla_attention(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        cache: LatentCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        T, H, R = q_lat.shape
        device = q_lat.device
        if T == 0:
            return q_lat.new_zeros((0, H, R))
        B, max_q, max_s = meta.num_seqs, meta.max_q_len, meta.max_seq_len
        bs = cache.block_size
        seq_of_tok, pos_in_seq = _token_layout(meta, T, device)

        # Gather the cache rows of each sequence: [B, n_blocks * bs, R] -> first max_s rows.
        n_blocks = (max_s + bs - 1) // bs
        seq_lens = torch.as_tensor(meta.seq_lens_host, dtype=torch.int64, device=device)
        q_lens = torch.as_tensor(meta.q_lens_host, dtype=torch.int64, device=device)
        tables = meta.block_tables[:, :n_blocks].to(device=device, dtype=torch.int64)
        used = torch.arange(n_blocks, device=device)[None, :] < ((seq_lens + bs - 1) // bs)[:, None]
        tables = torch.where(used, tables, torch.zeros_like(tables))  # unused entries may hold anything
        c = cache.c_kv[tables].reshape(B, n_blocks * bs, -1)[:, :max_s].to(q_lat.dtype)
        kpe = cache.k_pe[tables].reshape(B, n_blocks * bs, -1)[:, :max_s].to(q_pe.dtype)

        ql = _pad(q_lat, seq_of_tok, pos_in_seq, B, max_q)  # [B, Q, H, R]
        qp = _pad(q_pe, seq_of_tok, pos_in_seq, B, max_q)
        scores = (torch.einsum("bqhr,bkr->bhqk", ql, c) + torch.einsum("bqhp,bkp->bhqk", qp, kpe)) * scale

        # Mask [B, Q, K]: key k < seq_len, causal aligned to the end (or tree mask among new tokens).
        k_idx = torch.arange(max_s, device=device)[None, None, :]
        i_idx = torch.arange(max_q, device=device)[None, :, None]
        ctx = (seq_lens - q_lens)[:, None, None]  # cached tokens before the new ones
        in_seq = k_idx < seq_lens[:, None, None]
        if meta.tree_mask is None:
            among_new = k_idx <= ctx + i_idx
        else:
            tree = meta.tree_mask.to(device=device, dtype=torch.bool)
            j = (k_idx - ctx).clamp(0, tree.shape[-1] - 1).expand(B, max_q, max_s)
            among_new = torch.gather(tree[:, :max_q], 2, j)
        allowed = in_seq & ((k_idx < ctx) | among_new)
        # Padding query rows (i >= q_len) are dropped below; let them see key 0 to avoid NaN.
        allowed = allowed | ((i_idx >= q_lens[:, None, None]) & (k_idx == 0))

        out = _softmax_pv(scores, allowed[:, None], c, q_lat.dtype, "bhqk,bkr->bqhr")  # [B, Q, H, R]
        return out[seq_of_tok, pos_in_seq]

    def mla_prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        k_nope: torch.Tensor,
        k_pe: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        T, H, _ = q_nope.shape
        device = q_nope.device
        if T == 0:
            return v.new_zeros((0, H, v.shape[-1]))
        B, max_q = meta.num_seqs, meta.max_q_len
        seq_of_tok, pos_in_seq = _token_layout(meta, T, device)
        pad = lambda t: _pad(t, seq_of_tok, pos_in_seq, B, max_q)  # noqa: E731
        qn, qp, kn, kp, vv = pad(q_nope), pad(q_pe), pad(k_nope), pad(k_pe), pad(v)
        scores = (torch.einsum("bqhd,bkhd->bhqk", qn, kn) + torch.einsum("bqhp,bkp->bhqk", qp, kp)) * scale
        q_lens = torch.as_tensor(meta.q_lens_host, dtype=torch.int64, device=device)
        k_idx = torch.arange(max_q, device=device)[None, None, :]
        i_idx = torch.arange(max_q, device=device)[None, :, None]
        allowed = (k_idx <= i_idx) & (k_idx < q_lens[:, None, None])  # [B, Q, K]; row i >= 0 sees key 0
        out = _softmax_pv(scores, allowed[:, None], vv, v.dtype, "bhqk,bkhd->bqhd")
        return out[seq_of_tok, pos_in_seq]

    # ---- MoE -------------------------------------------------------------------------------
    def moe_gate(
        self,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        correction_bias: Optional[torch.Tensor],
        router: RouterConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.to(torch.float32), gate_weight.to(torch.float32))
        T, E = logits.shape
        k = router.top_k
        if router.scoring == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if router.topk_method == "greedy":
                weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
            elif router.topk_method == "group_limited_greedy":
                g = router.n_group
                group_scores = scores.view(T, g, E // g).max(dim=-1).values
                group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
                group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
                score_mask = group_mask.unsqueeze(-1).expand(T, g, E // g).reshape(T, E)
                scores = scores.masked_fill(~score_mask.bool(), 0.0)
                weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
            else:
                raise ValueError(f"softmax router does not support topk_method {router.topk_method!r}")
        elif router.scoring == "sigmoid":
            scores = logits.sigmoid()
            choice = scores if correction_bias is None else scores + correction_bias.to(torch.float32)
            g = router.n_group
            group_scores = choice.view(T, g, E // g).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(T, g, E // g).reshape(T, E)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
            ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        else:
            raise ValueError(f"unknown router scoring {router.scoring!r}")
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * router.routed_scaling_factor
        return weights.to(torch.float32), ids.to(torch.int64)

    def moe_experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts: ExpertWeights,
    ) -> torch.Tensor:
        out = torch.zeros_like(x)
        T, k = topk_ids.shape
        if T == 0:
            return out
        E = experts.w13.shape[0]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        sorted_ids = flat_ids[order]
        token_idx = order // k
        flat_w = topk_weights.reshape(-1)[order]
        # Ids outside [0, E) (e.g. experts owned by another rank) are skipped.
        counts = torch.bincount(sorted_ids.clamp(min=0), minlength=E + 1)
        counts[0] -= int((sorted_ids < 0).sum())  # sorted first, so skip them via the offset below
        start = int((sorted_ids < 0).sum())
        for e, n in enumerate(counts[:E].tolist()):
            if n == 0:
                continue
            sl = slice(start, start + n)
            start += n
            tok = token_idx[sl]
            h = F.linear(x[tok], experts.w13[e])
            h = F.linear(self.silu_and_mul(h), experts.w2[e])
            h = h * flat_w[sl, None]  # promotes to float32, as HF
            out.index_add_(0, tok, h.to(out.dtype))
        return out
