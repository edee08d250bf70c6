"""DeepSeek-V3 multi-token-prediction (MTP) module.

Module j pairs token t(i+1) with the previous stage's hidden state h(i):
    x = eh_proj(concat[enorm(embed(t(i+1))), hnorm(h(i))])      (embedding first, as DeepSeek)
    block_out = decoder_block(x)                                  (its own latent cache)
    logits = shared_head.head(shared_head.norm(block_out))
The first stage's h is the main model's hidden state after its final norm; a further MTP step
(the next module in MTP Vanilla, the same module again in MTP Eagle) takes block_out before the
shared-head norm, as vLLM does.
"""
from __future__ import annotations

import torch

from mindspec.backend import AttentionMetadata, Backend, IndexedRows, LatentCache, LinearWeight, RotaryEmbedding
from mindspec.modeling import quantized
from mindspec.modeling.quantized import Weight

from .config import DeepseekV2Config
from .decoder_layer import DecoderLayer
from .tensors import TensorBag


def _shared_or_own(own: Weight | None, main: Weight) -> Weight:
    # DeepSeek-V3 ships copies of the main embedding and lm_head in each module; keep one tensor.
    if own is None or quantized.same(own, main):
        return main
    return own


class MtpModule:
    def __init__(
        self,
        cfg: DeepseekV2Config,
        module_idx: int,
        w: TensorBag,
        backend: Backend,
        rotary: RotaryEmbedding,
        softmax_scale: float,
        main_embed: Weight,
        main_head: LinearWeight,
    ):
        self.backend = backend
        self.eps = cfg.rms_norm_eps
        self.module_idx = module_idx
        self.enorm = w.take("enorm.weight")
        self.hnorm = w.take("hnorm.weight")
        self.eh_proj = backend.linear_weight(w.take("eh_proj.weight"))  # [hidden, 2 * hidden]
        self.head_norm = w.take("shared_head.norm.weight")
        self.embed = _shared_or_own(w.take_optional("embed_tokens.weight"), main_embed)
        head = _shared_or_own(w.take_optional("shared_head.head.weight"), main_head.weight)
        self.head = main_head if head is main_head.weight else backend.linear_weight(head)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers + module_idx, w, backend, rotary, softmax_scale)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] tokens t(i+1)
        hidden_states: torch.Tensor | IndexedRows,  # [T, hidden] h(i) of the previous stage
        positions: torch.Tensor,  # [T]
        cache: LatentCache,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,  # [N]
        head_rows: torch.Tensor | None = None,  # [N]
        as_float: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (block_out [T, hidden] (or [N, hidden] for ``rows``: the only rows whose output is
        needed), the shared head's logits). block_out is before the head's norm: what a further
        MTP step takes. The head runs on ``head_rows`` of block_out (None: every row; the
        residual add and the head's norm may run inside its GEMM); logits are float32 unless
        ``as_float`` is False (the model dtype: enough for an argmax, one conversion less)."""
        x = self._block_input(input_ids, hidden_states)
        out, residual = self.block.forward(x, None, positions, cache, meta, rows)
        logits, block_out = self.backend.add_rms_norm_linear(out, residual, self.head_norm, self.eps, self.head,
                                                             head_rows, as_float)
        return block_out, logits

    def write_cache(
        self, input_ids: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor, cache: LatentCache,
        meta: AttentionMetadata,
    ) -> None:
        """Only the cache entries ``forward`` writes (what a last stage whose output goes unused needs)."""
        self.block.write_cache(self._block_input(input_ids, hidden_states), positions, cache, meta)

    def _block_input(self, input_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.backend.mtp_eh_proj(input_ids, self.embed, self.enorm, hidden_states, self.hnorm, self.eps,
                                        self.eh_proj)  # [T, hidden]
