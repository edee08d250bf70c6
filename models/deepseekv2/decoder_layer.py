"""One DeepSeek decoder block: pre-norm MLA and pre-norm MLP/MoE with fused residual adds."""
from __future__ import annotations

from typing import Optional

import torch

from mindspec.backend import AttentionMetadata, Backend, LatentCache, RotaryEmbedding

from .attention import MlaAttention
from .config import DeepseekV2Config
from .mlp import DeepseekMoe, DenseMlp
from .tensors import TensorBag


class DecoderLayer:
    def __init__(
        self,
        cfg: DeepseekV2Config,
        layer_idx: int,
        w: TensorBag,
        backend: Backend,
        rotary: RotaryEmbedding,
        softmax_scale: float,
    ):
        self.backend = backend
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = w.take("input_layernorm.weight")
        self.post_attention_layernorm = w.take("post_attention_layernorm.weight")
        self.self_attn = MlaAttention(cfg, w.scope("self_attn."), backend, rotary, softmax_scale)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = DeepseekMoe(
                w.scope("mlp."), backend, cfg.router, cfg.n_routed_experts, cfg.n_shared_experts > 0
            )
        else:
            self.mlp = DenseMlp(w.scope("mlp."), backend)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] block input, or the previous block's output before its residual add
        residual: Optional[torch.Tensor],  # [T, hidden] or None for the first block
        positions: torch.Tensor,
        cache: LatentCache,
        meta: AttentionMetadata,
        rows: Optional[torch.Tensor] = None,  # [N]: only these rows of the output are needed
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp_out, residual); the block output is mlp_out + residual, left unadded so the
        next norm can fuse the add (vLLM's convention). With ``rows`` both are [N, hidden]: every
        token still writes its cache entry, but only those rows run o_proj and the MLP."""
        h, residual = self.self_attn.forward(x, residual, self.input_layernorm, positions, cache, meta, rows)
        if rows is None:
            h, residual = self.backend.add_rms_norm(h, residual, self.post_attention_layernorm, self.eps)
        else:
            norm = self.post_attention_layernorm
            h, residual = self.backend.add_rms_norm_rows(h, residual, rows, norm, self.eps)
        return self.mlp.forward(h), residual

    def write_cache(self, x: torch.Tensor, positions: torch.Tensor, cache: LatentCache, meta: AttentionMetadata) -> None:
        """The cache entries ``forward`` would write for block input x (first block: no residual),
        without the attention output and the MLP."""
        self.self_attn.write_cache(self.backend.rms_norm(x, self.input_layernorm, self.eps), positions, cache, meta)
