"""Multi-head latent attention (MLA) over a paged cache that holds only the latent.

Per token and layer the cache keeps c_kv = kv_a_layernorm(latent) (kv_lora_rank values) and the
roped k_pe (qk_rope_head_dim values). Sequences with no cached context (a plain prefill) expand K/V
through kv_b_proj and run ordinary causal attention; everything else (decode, MTP verification,
context continuation) absorbs kv_b_proj into the query and the output, so K/V are never expanded:
q_lat = q_nope . W_UK against c_kv, and o = o_lat . W_UV^T.
"""
from __future__ import annotations

from typing import Optional

import torch

from mindspec.backend import AttentionMetadata, Backend, LatentCache, RotaryEmbedding
from mindspec.modeling import quantized

from .config import DeepseekV2Config
from .tensors import TensorBag


class MlaAttention:
    def __init__(
        self,
        cfg: DeepseekV2Config,
        w: TensorBag,
        backend: Backend,
        rotary: RotaryEmbedding,
        softmax_scale: float,
    ):
        self.backend = backend
        self.rotary = rotary
        self.scale = softmax_scale
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        kv_a = w.take("kv_a_proj_with_mqa.weight")  # [R + P, hidden]
        if cfg.q_lora_rank is None:
            self.q_proj = backend.linear_weight(w.take("q_proj.weight"))  # [H * (nope + rope), hidden]
            self.qkv_a_proj = None
            self.kv_a_proj = backend.linear_weight(kv_a)
        else:
            # One GEMM for both down-projections of the block input (vLLM's fused_qkv_a_proj):
            # rows [q_a | kv_a]; kv_a_proj stays a view for callers that need only the latents.
            self.q_lora_rank = cfg.q_lora_rank
            qkv_a = quantized.cat_rows([w.take("q_a_proj.weight"), kv_a])  # [q_lora + R + P, hidden]
            self.qkv_a_proj = backend.linear_weight(qkv_a)
            self.kv_a_proj = backend.linear_weight(quantized.rows(qkv_a, self.q_lora_rank))
            self.q_a_layernorm = w.take("q_a_layernorm.weight")
            self.q_b_proj = backend.linear_weight(w.take("q_b_proj.weight"))  # [H * (nope + rope), q_lora]
        self.kv_a_layernorm = w.take("kv_a_layernorm.weight")  # [R]
        kv_b = w.take("kv_b_proj.weight")  # [H * (nope + v), R], rows per head: [k_nope | v]
        self.kv_b_proj = backend.linear_weight(kv_b)
        per_head = kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = backend.head_weight(per_head[:, : self.nope_dim].contiguous())  # [H, nope, R]
        self.w_uv_t = backend.head_weight(per_head[:, self.nope_dim :].transpose(1, 2).contiguous())  # [H, R, v]
        self.o_proj = backend.linear_weight(w.take("o_proj.weight"))  # [hidden, H * v]

    def _project(
        self, x: torch.Tensor, residual: Optional[torch.Tensor], input_norm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block input (see ``forward``) -> (q [T, H, nope + rope], kv_a [T, R + P], the
        residual stream [T, hidden]). Where one fused q_a / kv_a projection reads the normed
        input, the norm (and the residual add) may run inside its GEMM."""
        if self.qkv_a_proj is None:
            if residual is None:
                h, residual = self.backend.rms_norm(x, input_norm, self.eps), x
            else:
                h, residual = self.backend.add_rms_norm(x, residual, input_norm, self.eps)
            q, kv_a = self.backend.linear(h, self.q_proj), self.backend.linear(h, self.kv_a_proj)
        else:
            if residual is None:
                qkv_a, residual = self.backend.rms_norm_linear(x, input_norm, self.eps, self.qkv_a_proj), x
            else:
                qkv_a, residual = self.backend.add_rms_norm_linear(x, residual, input_norm, self.eps, self.qkv_a_proj)
            q_a, kv_a = qkv_a.split([self.q_lora_rank, self.kv_a_proj.weight.shape[0]], dim=-1)
            q = self.backend.rms_norm_linear(q_a, self.q_a_layernorm, self.eps, self.q_b_proj)
        return q.view(x.shape[0], self.num_heads, self.nope_dim + self.rope_dim), kv_a, residual

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor], input_norm: torch.Tensor, positions: torch.Tensor,
        cache: LatentCache, meta: AttentionMetadata, rows: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block input: x [T, hidden] (the first block's input, ``residual`` None) or the
        previous block's output before its residual add -> (attention output [T, hidden], or
        [N, hidden] for ``rows`` [N] alone (o_proj on those rows only); the residual stream
        x + residual [T, hidden]). Applies the block's input norm (``input_norm``'s weight);
        writes every token's latents into ``cache``."""
        q, kv_a, residual = self._project(x, residual, input_norm)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # q_pe not yet roped
        c_kv, k_pe = self._write_latents(kv_a, positions, cache, meta)
        if meta.is_prefill and meta.tree_mask is None:
            out = self._prefill(q_nope, self.backend.rope(q_pe, positions, self.rotary), c_kv, k_pe, meta)
        else:
            out = self._absorbed(q_nope, q_pe, positions, cache, meta)
        out = out.reshape(x.shape[0], self.num_heads * self.v_dim)
        if rows is None:
            return self.backend.linear(out, self.o_proj), residual
        return self.backend.linear_rows(out, rows, self.o_proj), residual

    def write_cache(
        self, x: torch.Tensor, positions: torch.Tensor, cache: LatentCache, meta: AttentionMetadata
    ) -> None:
        """Only the cache entries ``forward`` writes for x [T, hidden]: the latents depend on x
        alone, so a caller that needs no attention output stops here."""
        self._write_latents(self.backend.linear(x, self.kv_a_proj), positions, cache, meta)

    def _write_latents(
        self, kv_a: torch.Tensor, positions: torch.Tensor, cache: LatentCache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_a [T, R + P] -> (c_kv [T, R], roped k_pe [T, P]), written into ``cache`` at meta.slots."""
        return self.backend.latent_norm_rope_cache(
            kv_a, self.kv_a_layernorm, self.eps, positions, self.rotary, cache, meta.slots
        )

    def _prefill(self, q_nope, q_pe, c_kv, k_pe, meta) -> torch.Tensor:
        kv = self.backend.linear(c_kv, self.kv_b_proj).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return self.backend.mla_prefill(q_nope, q_pe, k_nope, k_pe, v, meta, self.scale)  # [T, H, v]

    def _absorbed(self, q_nope, q_pe, positions, cache, meta) -> torch.Tensor:
        q_lat = self.backend.head_linear(q_nope, self.w_uk)  # [T, H, R]
        o_lat = self.backend.rope_mla_attention(q_lat, q_pe, positions, self.rotary, cache, meta, self.scale)
        return self.backend.head_linear(o_lat, self.w_uv_t)  # [T, H, v]
