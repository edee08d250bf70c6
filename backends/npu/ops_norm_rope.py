"""RMSNorm, SwiGLU, rope and the latent-cache write on torch_npu.

npu_rms_norm / npu_add_rms_norm / npu_swiglu take every float dtype; the rope ops need rope dim 64
in float16/bfloat16 and the fused latent step (npu_kv_rmsnorm_rope_cache) needs latent 512 + rope
64; outside that the composed torch path runs.
"""
from __future__ import annotations

import torch

from mindspec.backend import LatentCache, RotaryEmbedding

from .limits import HALF_DTYPES, latent_cache_refusal, rope_refusal
from .op_group import OpGroup
from .rope_layout import half_cos_sin, to_half_order, to_interleaved


class NormRopeOps(OpGroup):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dtype != x.dtype:
            self.fallbacks.note("rms_norm", f"weight {weight.dtype} != input {x.dtype}")
            return self.composed.rms_norm(x, weight, eps)
        y, _rstd = self.npu.npu_rms_norm(x, weight, epsilon=eps)
        return y

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        if not (x.dtype == residual.dtype == weight.dtype):
            self.fallbacks.note("add_rms_norm", f"mixed dtypes {x.dtype}/{residual.dtype}/{weight.dtype}")
            return self.composed.add_rms_norm(x, residual, weight, eps)
        y, _rstd, summed = self.npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
        return y, summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.npu.npu_swiglu(x, dim=-1)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        T, H, P = x.shape
        reason = rope_refusal(P, x.dtype)
        if reason:
            self.fallbacks.note("rope", reason)
            return self.composed.rope(x, positions, rotary)
        cos, sin = half_cos_sin(rotary, positions, x.dtype)  # [T, P] each
        # [T, H, 1, P] = [B, N, S, D] with B = tokens, S = 1; cos/sin [B, 1, S, D]
        out = self.npu.npu_interleave_rope(x.contiguous().view(T, H, 1, P), cos.view(T, 1, 1, P), sin.view(T, 1, 1, P))
        return to_interleaved(out.view(T, H, P))

    # ---- latent cache ----------------------------------------------------------------------
    def write_latent_cache(self, cache: LatentCache, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
        """Stores k_pe in half order (the layout the fused rope-and-cache op writes)."""
        k_half = to_half_order(k_pe)
        dtype = cache.c_kv.dtype
        if dtype not in HALF_DTYPES:
            self.fallbacks.note("write_latent_cache", f"cache dtype {dtype} (npu_scatter_pa_kv_cache: float16/bfloat16)")
            return self.composed.write_latent_cache(cache, c_kv, k_half, slots)
        (T, R), P = c_kv.shape, k_pe.shape[-1]
        if T == 0:
            return
        self.npu.npu_scatter_pa_kv_cache(
            c_kv.to(dtype).contiguous().view(T, 1, R),  # key   [T, heads 1, R]
            k_half.to(dtype).contiguous().view(T, 1, P),  # value [T, heads 1, P]
            cache.c_kv.unsqueeze(2),  # [nb, bs, 1, R]
            cache.k_pe.unsqueeze(2),  # [nb, bs, 1, P]
            slots.to(torch.int64),
            cache_mode="Norm",
        )

    def latent_norm_rope_cache(self, kv_a, norm_weight, eps, positions, rotary, cache, slots):
        rank = norm_weight.shape[0]
        T, width = kv_a.shape
        rope = width - rank
        reason = latent_cache_refusal(rank, rope, kv_a.dtype)
        if reason is None and not (norm_weight.dtype == cache.c_kv.dtype == kv_a.dtype):
            reason = f"dtypes kv {kv_a.dtype}, gamma {norm_weight.dtype}, cache {cache.c_kv.dtype} differ"
        if reason:
            self.fallbacks.note("latent_norm_rope_cache", reason)
            c_kv = self.rms_norm(kv_a[:, :rank], norm_weight, eps)
            k_pe = self.rope(kv_a[:, None, rank:], positions, rotary)[:, 0]
            self.write_latent_cache(cache, c_kv, k_pe, slots)
            return c_kv, k_pe
        cos, sin = half_cos_sin(rotary, positions, kv_a.dtype)  # [T, 64] each
        _, _, k_embed, c_kv = self.npu.npu_kv_rmsnorm_rope_cache(
            kv_a.contiguous().view(T, 1, 1, width),  # [B, 1, S, 576] with B = tokens, S = 1
            norm_weight,
            cos.view(T, 1, 1, rope),
            sin.view(T, 1, 1, rope),
            slots.to(torch.int64),  # flat slot per token; -1 = padding, not written
            cache.k_pe.unsqueeze(2),  # k_cache   [nb, bs, 1, 64]
            cache.c_kv.unsqueeze(2),  # ckv_cache [nb, bs, 1, 512]
            epsilon=eps,
            cache_mode="PA",
            is_output_kv=True,
        )
        return c_kv.view(T, rank), to_interleaved(k_embed.view(T, rope))
