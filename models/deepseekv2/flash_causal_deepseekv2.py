"""FlashCausalDeepseekV2: the DeepSeek-V2/V3 main model and its MTP modules on a paged latent cache.

The model sees flat token-major batches and cache metadata, never requests. All device work goes
through the Backend; this file has no device checks. Entry points:

- ``forward``: the main model -> logits at ``lm_head_indices`` and the hidden states of every token
  (after the final norm, which is what the first MTP step consumes);
- ``forward_mtp``: one MTP module step (MTP Vanilla calls modules 0..K-1 once each, MTP Eagle calls
  module 0 K times over the same cache) -> logits at ``lm_head_indices`` and block outputs.

Caches are one LatentCache per layer: main layers 0..L-1, then MTP module j at index L + j.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from mindspec.backend import AttentionMetadata, Backend, IndexedRows, LatentCache, shift_in
from mindspec.modeling.loader import checkpoint_keys, load_checkpoint
from mindspec.modeling.model_path import is_gguf
from mindspec.modeling.rotary import build_rotary, softmax_scale

from .config import DeepseekV2Config, ModelConfigError
from .decoder_layer import DecoderLayer
from .mtp import MtpModule
from .tensors import TensorBag
from .weights import QUANTIZED_WEIGHTS, ignored_patterns, layer_prefix, model_specs, mtp_modules_in


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [N, vocab] float32, rows at lm_head_indices
    hidden_states: torch.Tensor  # [T, hidden] every token (main: after the final norm; MTP: block output)
    draft_tokens: Optional[torch.Tensor] = None  # [B, K] from forward_speculative
    greedy_tokens: Optional[torch.Tensor] = None  # [N] argmax of logits, where a captured graph computed it
    accepted_drafts: Optional[torch.Tensor] = None  # [B] where the step accepted greedily (modeling/hidden_cache.py)


# (draft step logits [B, V], the drafts of the steps before [B] each) -> the logits to take the argmax of
DraftLogits = Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]


@dataclass
class DraftStep:
    """Where one MTP draft step reads and writes: its module, positions and cache metadata.

    A step runs over the rows of the draft's input layout, or, with ``lm_rows_only``, over each
    sequence's lm_head row alone (one row per sequence, in sequence order): what an MTP Eagle step
    after the first needs, since its other rows write no cache entry and feed nothing the next
    step uses (TensorRT-LLM and vLLM feed those steps one token per sequence). Such steps come
    last: after one, the full-layout hidden states no longer exist."""

    module_idx: int
    positions: torch.Tensor  # [Ts], or [B] with lm_rows_only
    meta: AttentionMetadata  # slots -1 where this step must not write (padding, verified entries)
    lm_rows_only: bool = False


class FlashCausalDeepseekV2:
    def __init__(
        self,
        cfg: DeepseekV2Config,
        tensors: dict[str, torch.Tensor],
        backend: Backend,
        num_mtp_modules: int = 0,
    ):
        self.cfg = cfg
        self.backend = backend
        self.num_mtp_modules = num_mtp_modules
        self.dtype = tensors["model.embed_tokens.weight"].dtype
        self.rotary = build_rotary(cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings)
        self.rotary.build_cache(cfg.max_position_embeddings, backend.device)
        scale = softmax_scale(cfg.qk_head_dim, cfg.rope)
        bag = TensorBag(tensors)
        self.embed = bag.take("model.embed_tokens.weight")  # [vocab, hidden]
        self.norm = bag.take("model.norm.weight")
        lm_head = bag.take_optional("lm_head.weight")
        # tie_word_embeddings: the embedding is the head
        self.lm_head = backend.linear_weight(self.embed if lm_head is None else lm_head)  # [vocab, hidden]
        self.layers = [
            DecoderLayer(cfg, i, bag.scope(layer_prefix(i)), backend, self.rotary, scale)
            for i in range(cfg.num_hidden_layers)
        ]
        self.mtp_modules = [
            MtpModule(
                cfg, j, bag.scope(layer_prefix(cfg.num_hidden_layers + j)), backend,
                self.rotary, scale, self.embed, self.lm_head,
            )
            for j in range(num_mtp_modules)
        ]
        if bag.remaining():
            raise ModelConfigError(f"checkpoint tensors left unused by the model: {bag.remaining()[:5]}")

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        backend: Backend,
        dtype: torch.dtype = torch.bfloat16,
        num_mtp_modules: Optional[int] = None,
        progress: bool = True,
        keep_quantized: bool = True,
    ) -> "FlashCausalDeepseekV2":
        """Load a Hugging Face-layout checkpoint or a GGUF file; ``num_mtp_modules`` None loads
        every MTP module the checkpoint holds (config.json's num_nextn_predict_layers at most).
        Quantized weights (block FP8, GGUF) stay quantized where the backend runs them so
        (``keep_quantized`` and ``backend.keeps_quantized``: the embedding, the GEMM weights and
        the head, QUANTIZED_WEIGHTS); every other weight is dequantized into ``dtype``."""
        cfg = DeepseekV2Config.from_model_dir(model_dir)
        keys = checkpoint_keys(model_dir)
        available = min(cfg.num_nextn_predict_layers, mtp_modules_in(cfg, keys))
        if num_mtp_modules is None:
            num_mtp_modules = available
        if num_mtp_modules > available:
            raise ModelConfigError(
                f"{num_mtp_modules} MTP module(s) requested but the checkpoint has {available} "
                f"(config.json num_nextn_predict_layers={cfg.num_nextn_predict_layers})"
            )
        tensors = load_checkpoint(
            model_dir,
            model_specs(cfg, num_mtp_modules),
            dtype,
            ignore=ignored_patterns(cfg, num_mtp_modules, keys),
            device=str(backend.device),
            progress=progress,
            keep_quantized=QUANTIZED_WEIGHTS if keep_quantized and backend.keeps_quantized(_format(model_dir)) else None,
        )
        return cls(cfg, tensors, backend, num_mtp_modules)

    @property
    def num_cache_layers(self) -> int:
        return self.cfg.num_hidden_layers + self.num_mtp_modules

    def allocate_caches(self, num_blocks: int, block_size: int, dtype: Optional[torch.dtype] = None) -> list[LatentCache]:
        """One latent cache per main layer and per MTP module, all addressed by the same slots."""
        return [
            self.backend.allocate_latent_cache(
                num_blocks, block_size, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim, dtype or self.dtype
            )
            for _ in range(self.num_cache_layers)
        ]

    def cache_bytes_per_token(self, dtype: Optional[torch.dtype] = None) -> int:
        itemsize = torch.empty((), dtype=dtype or self.dtype).element_size()
        return self.num_cache_layers * self.cfg.latent_dim * itemsize

    # ---- forward -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        caches: list[LatentCache],
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor,  # [N] int64 rows of the flat batch that need logits
    ) -> ModelOutput:
        x = self.backend.embedding(input_ids, self.embed)  # [T, hidden]
        residual = None
        for layer, cache in zip(self.layers, caches):
            x, residual = layer.forward(x, residual, positions, cache, meta)
        hidden, _ = self.backend.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        logits = self.backend.linear_rows(hidden, lm_head_indices, self.lm_head, float_out=True)
        return ModelOutput(logits=logits, hidden_states=hidden)

    def forward_mtp(
        self,
        module_idx: int,
        input_ids: torch.Tensor,  # [T] tokens t(i+1)
        hidden_states: torch.Tensor | IndexedRows,  # [T, hidden] h(i) from the main model or the previous MTP step
        positions: torch.Tensor,  # [T] (position i: the convention of mindspec, see DESIGN.md 5)
        caches: list[LatentCache],
        meta: AttentionMetadata,
        lm_head_indices: Optional[torch.Tensor],  # [N]; None: every row
        lm_rows_out: bool = False,
        float_logits: bool = True,
    ) -> ModelOutput:
        """-> logits [N, vocab] and the block output [T, hidden] for the next stage. With
        ``lm_rows_out`` (the last stage, or one whose next stage takes only its lm_head rows) only
        those rows run past attention (hidden_states [N, hidden]). Logits are float32 unless
        ``float_logits`` is False (the model dtype: what a draft's argmax needs)."""
        module = self.mtp_modules[module_idx]
        cache = caches[self.cfg.num_hidden_layers + module_idx]
        rows_only = lm_rows_out or lm_head_indices is None
        block_out, logits = module.forward(input_ids, hidden_states, positions, cache, meta,
                                           lm_head_indices if rows_only else None,
                                           None if rows_only else lm_head_indices, float_logits)
        return ModelOutput(logits=logits, hidden_states=block_out)

    def draft(
        self,
        input_ids: torch.Tensor,  # [Ts] sub_model_inputs tokens: accepted tokens, padded per sequence
        hidden_states: torch.Tensor | IndexedRows,  # [Ts, hidden] the main hidden states that produced them
        lm_head_indices: torch.Tensor,  # [B] row of each sequence's newest entry
        steps: list[DraftStep],
        caches: list[LatentCache],
        draft_logits: Optional[DraftLogits] = None,
    ) -> list[torch.Tensor]:
        """K greedy MTP steps -> each step's drafts [B]. Each step rolls its input left by one and puts
        the new draft at the lm_head index; the block output becomes the next step's hidden state.
        A step before an ``lm_rows_only`` one hands on its lm_head rows alone: the new drafts and
        their block outputs. ``draft_logits(logits, drafts so far)`` may rewrite each step's
        logits [B, V] before the argmax (structured output masks them)."""
        drafts = []
        ids, hidden = input_ids, hidden_states
        for k, step in enumerate(steps):
            following = steps[k + 1] if k + 1 < len(steps) else None
            lm = None if step.lm_rows_only else lm_head_indices
            lm_rows_out = following is None or following.lm_rows_only  # only lm_head rows feed on
            out = self.forward_mtp(step.module_idx, ids, hidden, step.positions, caches, step.meta, lm, lm_rows_out,
                                   float_logits=draft_logits is not None)
            logits = out.logits if draft_logits is None else draft_logits(out.logits, drafts)
            if following is None or following.lm_rows_only:
                draft = ids = logits.argmax(dim=-1)  # [B]
            else:
                draft, ids = self.backend.argmax_shift_in(logits, ids, lm_head_indices)
            drafts.append(draft)
            hidden = out.hidden_states
        return drafts

    def forward_speculative(
        self,
        input_ids: torch.Tensor,  # [B * (K + 1)] last accepted token per sequence, then K slots for drafts
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor,  # [B * (K + 1)] every row is verified
        sub_input_ids: torch.Tensor,
        sub_hidden_states: torch.Tensor | IndexedRows,  # [Ts, hidden] (draft's hidden_states)
        lm_head_local_dp: torch.Tensor,  # [B] drafter lm_head rows on this dp rank (seed 000's name)
        steps: list[DraftStep],
        caches: list[LatentCache],
        verify_source: Optional[torch.Tensor] = None,  # [R] per row: its token in cat(input_ids, drafts)
        draft_logits: Optional[DraftLogits] = None,  # see ``draft``
    ) -> ModelOutput:
        """Decode with MTP in one call: draft K tokens, then the main model verifies
        [last token, d1..dK] per sequence (seed 000: drafts fill input_ids.view(B, K+1)[:, 1:]).
        With ``verify_source``, sequence b verifies only its first k_b <= K drafts: its rows are
        [last token, d1..d_kb] (ragged q_lens) and each row takes its token from the flat
        concatenation of input_ids and the [B * K] drafts (draft_rows.verify_source); a sequence
        whose drafts were made on the host (suffix drafts, any number) keeps its own input rows."""
        drafts = self.draft(sub_input_ids, sub_hidden_states, lm_head_local_dp, steps, caches, draft_logits)
        num_seqs, k = drafts[0].shape[0], len(drafts)
        if verify_source is None:  # [last token, d1..dK] per sequence: one concat, the drafts a view of it
            ids = torch.cat([input_ids.view(num_seqs, k + 1)[:, :1], *(d[:, None] for d in drafts)], dim=1)
            draft_tokens = ids[:, 1:]  # [B, K]
        else:
            draft_tokens = torch.stack(drafts, dim=1)  # [B, K]
            ids = torch.cat([input_ids, draft_tokens.reshape(-1)])[verify_source]
        out = self.forward(ids.view(-1), positions, caches, meta, lm_head_indices)
        out.draft_tokens = draft_tokens
        return out

    def forward_prefill_mtp(
        self,
        input_ids: torch.Tensor,  # [T] prompts
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor,  # [B] last token of each prompt
        mtp_modules: list[int],  # vanilla: 0..K-1, eagle: [0]
        caches: list[LatentCache],
        next_tokens: Optional[torch.Tensor] = None,  # [B, len(mtp_modules)] known next tokens, -1: unknown
    ) -> ModelOutput:
        """Prefill the main model, then the MTP module(s) over the prompt shifted by one plus the
        new (greedy) token, so every MTP cache holds the prompt; the drafts are dropped (seed 000):
        the first decode step rewrites the entry of the new token with the token actually sampled.
        So the last module's output is never used: it only writes its cache (no attention output,
        no MLP over the prompt; eagle's one module costs a projection per prompt token).
        ``next_tokens``: a prefill chunk that ends before its prompt does shifts in the prompt's
        next tokens instead of drafts (stage m takes column m)."""
        out = self.forward(input_ids, positions, caches, meta, lm_head_indices)
        ids = shift_in(input_ids, _known_or(next_tokens, 0, out.logits.argmax(dim=-1)), lm_head_indices)
        hidden = out.hidden_states
        *feeding, last = mtp_modules
        for stage, m in enumerate(feeding, start=1):  # vanilla: module m's output and draft feed module m + 1
            step = self.forward_mtp(m, ids, hidden, positions, caches, meta, lm_head_indices)
            new = _known_or(next_tokens, stage, step.logits.argmax(dim=-1))
            ids, hidden = shift_in(ids, new, lm_head_indices), step.hidden_states
        self.mtp_modules[last].write_cache(ids, hidden, positions, caches[self.cfg.num_hidden_layers + last], meta)
        return out


def _known_or(next_tokens: Optional[torch.Tensor], stage: int, drafts: torch.Tensor) -> torch.Tensor:
    """[B] column ``stage`` of next_tokens where it holds a token, else the draft."""
    if next_tokens is None:
        return drafts
    known = next_tokens[:, stage]
    return torch.where(known >= 0, known, drafts)


def _format(model_dir: str | Path) -> str:
    """The quantized format a checkpoint may hold, as Backend.keeps_quantized names it."""
    return "gguf" if is_gguf(model_dir) else "fp8"
