"""PluginManager: one decoding step for a scheduled batch (MindIE's ``generate_token``).

    compose model inputs (host, numpy)
    -> plugins: model_inputs_update         (MTP: q_lens, sub_model_inputs, hidden_states)
    -> generator forward (plugins that draft drive their own forward)
    -> plugins: sample_preprocess           (MTP: one sampling row per draft position)
    -> plugins: token_bitmask               (structured output: the tokens each row may take)
    -> sampler
    -> plugins: plugin_verify               (MTP: decoding policy, accepted tokens per sequence)
    -> plugins: plugin_cache_update         (MTP: hidden states for the next step)
With no plugin this is plain autoregressive decoding: one row, one token per sequence.
``plugin_cache_clear`` runs when the engine retires sequences.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import numpy as np

from mindspec.modeling.forward_metadata import build_decode_inputs, build_model_inputs, row_grid
from mindspec.plugins.plugin import Plugin, PluginError
from mindspec.text_generator import prompt_logprobs
from mindspec.text_generator.generator import Generator, GeneratorOutput
from mindspec.text_generator.sampling.metadata import SamplingMetadata
from mindspec.text_generator.sampling.sampler import Sampler
from mindspec.text_generator.sampling.step_targets import TargetRows, samples_in_step
from mindspec.text_generator.step import PLACEHOLDER_TOKEN, StepBatch, StepInputs, StepOutputs, accepted_in_step


class PluginManager:
    def __init__(
        self,
        generator: Generator,
        sampler: Optional[Sampler] = None,
        plugins: Seq[Plugin] = (),
        vocab_size: Optional[int] = None,
        eos_token_ids: Seq[int] = (),
    ):
        self.generator = generator
        self.sampler = sampler or Sampler()
        self.plugins = list(plugins)
        drafters = [p.name for p in self.plugins if p.num_lookahead_tokens > 0]
        if len(drafters) > 1:
            raise PluginError(f"plugin_params.plugin_type: {' and '.join(drafters)} both draft; one drafter per engine")
        self.vocab_size = vocab_size or generator.model_wrapper.config.vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @property
    def num_lookahead_tokens(self) -> int:
        return max((p.num_lookahead_tokens for p in self.plugins), default=0)

    @property
    def draft_positions(self) -> int:
        """The most drafts one sequence can have accepted in a step (a tree's depth, else the lookahead)."""
        return max((getattr(p, "draft_positions", p.num_lookahead_tokens) for p in self.plugins), default=0)

    @property
    def kv_context_tokens(self) -> int:
        return max((p.kv_context_tokens for p in self.plugins), default=0)

    # ---- one step ------------------------------------------------------------------------------
    def generate_token(self, batch: StepBatch) -> StepOutputs:
        return self.execute(batch, self.prepare(batch))

    def prepare(self, batch: StepBatch) -> StepInputs:
        """Host: compose the step's model inputs and let the plugins rewrite them."""
        inputs = self.compose_model_inputs(batch)
        for plugin in self.plugins:
            inputs = plugin.model_inputs_update(batch, inputs)
        self._targets_in_step(batch, inputs)
        return inputs

    def execute(self, batch: StepBatch, inputs: StepInputs) -> StepOutputs:
        """Device: forward, sample, verify; then the plugins' caches for the next step."""
        outputs = self.forward(batch, inputs)
        if (batch.is_prefill or batch.is_mixed) and any(prompt_logprobs.wanted(s) for s in batch.seqs):
            outputs.prompt_logprobs = prompt_logprobs.compute(
                batch.seqs, inputs.model_inputs, outputs.hidden_states, self.generator.model_wrapper.lm_head_logits
            )
        for plugin in self.plugins:
            inputs = plugin.sample_preprocess(batch, inputs)
        self.sample(batch, inputs, outputs)
        # Without a drafter every sequence has one row and keeps its sampled token.
        outputs.accepted = [[int(t)] for t in outputs.sampled[: len(batch)]]
        outputs.accepted_rows = [[i] for i in range(len(batch))]
        if batch.is_mixed:  # a chunk before a prompt's last yields no token
            for b in np.flatnonzero(batch.chunk_rows() & ~batch.prefill_ends()):
                outputs.accepted[b], outputs.accepted_rows[b] = [], []
        for plugin in self.plugins:
            outputs = plugin.plugin_verify(batch, inputs, outputs)
        for plugin in self.plugins:
            plugin.plugin_cache_update(batch, inputs, outputs)
        return outputs

    # ---- async scheduling -------------------------------------------------------------------
    def prepare_ahead(self, batch: StepBatch, pending: np.ndarray) -> StepInputs:
        """Host, while the previous step runs: ``prepare`` for a batch whose sequences with
        ``pending[b] > 0`` end in that many placeholder tokens (the previous step's, unknown yet)."""
        inputs = self.compose_model_inputs(batch)
        for plugin in self.plugins:
            inputs = plugin.prepare_masks_for_filling(batch, inputs, pending)
        return inputs

    def fill_in_model_result(self, batch: StepBatch, inputs: StepInputs, pending: np.ndarray,
                             accepted: list[list[int]]) -> None:
        """Device, before the step runs: replace the placeholders with the previous step's
        accepted tokens (``accepted[b]``: 1..pending[b] tokens of sequence b). The sequences'
        views hold the real tokens first, so plugins may draft from them."""
        for seq, n, toks in zip(batch.seqs, pending, accepted):
            if n:  # the view's n placeholders become the len(toks) real tokens (history and positions)
                seq.output_token_ids[-n:] = toks
                seq.num_cached_tokens -= int(n) - len(toks)
        for plugin in self.plugins:
            plugin.fill_in_model_result(batch, inputs, pending, accepted)
        self._targets_in_step(batch, inputs)
        ids = inputs.model_inputs.input_ids
        rows = np.flatnonzero(ids == PLACEHOLDER_TOKEN)
        if len(rows):  # the fed last token of a sequence: its newest accepted token
            owner = np.repeat(np.arange(len(batch)), inputs.model_inputs.q_lens)[rows]
            ids[rows] = [accepted[b][-1] for b in owner]

    # ---- prefix caching ---------------------------------------------------------------------------
    def enable_prefix_caching(self) -> None:
        for plugin in self.plugins:
            plugin.enable_prefix_caching()

    def final_kv_tokens(self, seq, finished: bool = False) -> int:
        """Leading positions of ``seq`` whose KV is final in the main cache and in every plugin's
        caches (what the prefix cache may keep); ``finished``: the sequence has ended."""
        final = seq.num_cached_tokens
        for plugin in self.plugins:
            own = plugin.final_cache_positions(seq, finished)
            if own is not None:
                final = min(final, own)
        return final

    def clear(self, seq_ids: list[int]) -> None:
        for plugin in self.plugins:
            plugin.plugin_cache_clear(seq_ids)

    # ---- stages --------------------------------------------------------------------------------
    def compose_model_inputs(self, batch: StepBatch) -> StepInputs:
        """Prefill feeds every uncached token (the prompt, or prompt + output after a preemption);
        decode feeds the last token; a mixed step both, a chunk at a time. Logits are taken at
        each sequence's last fed token."""
        seqs = batch.seqs
        cached = [s.num_cached_tokens for s in seqs]
        if not batch.is_prefill and not batch.is_mixed and all(s.num_tokens == c + 1 for s, c in zip(seqs, cached)):
            model_inputs = build_decode_inputs([s.last_token_id for s in seqs], cached, [s.block_table for s in seqs],
                                               batch.block_size)
        else:
            tokens = [s.tokens_from(c) for s, c in zip(seqs, cached)]
            if batch.is_mixed:  # a chunk: the next ``chunk`` uncached tokens; a decode row: the last
                tokens = [t[:c] if c else t for t, c in zip(tokens, batch.chunks)]
            model_inputs = build_model_inputs(tokens, cached, [s.block_table for s in seqs], batch.block_size)
        n = len(seqs)
        return StepInputs(
            model_inputs=model_inputs,
            q_lens=model_inputs.q_lens,
            row_seq=np.arange(n, dtype=np.int64),
            row_offset=np.zeros(n, dtype=np.int64),
        )

    def forward(self, batch: StepBatch, inputs: StepInputs) -> StepOutputs:
        for plugin in self.plugins:
            drive = getattr(plugin, "forward", None)
            if drive is not None:
                out: GeneratorOutput = drive(batch, inputs, self.generator)
                break
        else:
            out = self.generator.forward(inputs.model_inputs, targets=inputs.extra.get("targets"))
        return StepOutputs(logits=out.logits, hidden_states=out.hidden_states, draft_tokens=out.draft_tokens,
                           greedy_tokens=out.greedy_tokens, accepted_drafts=out.accepted_drafts,
                           host_drafts=inputs.extra.get("host_drafts"))

    def _plain_greedy(self, batch: StepBatch) -> bool:
        return (not any(p.needs_sampling_metadata for p in self.plugins)
                and all(s.sampling_params.plain_greedy for s in batch.seqs))

    def row_prefixes(self, batch: StepBatch, inputs: StepInputs, draft_prefix: Optional[np.ndarray] = None) -> list[list[int]]:
        """Per logits row: the draft tokens between its sequence's output and the token it samples
        (``inputs.extra["row_prefix"][r]`` for a tree's path, else the first row_offset[r] of its
        sequence's drafts)."""
        row_prefix = inputs.extra.get("row_prefix")
        if row_prefix is not None:
            return [list(p) for p in row_prefix]
        if draft_prefix is None:
            return [[] for _ in inputs.row_seq]
        return [draft_prefix[b, :k].tolist() for b, k in zip(inputs.row_seq, inputs.row_offset)]

    def sampling_metadata(self, batch: StepBatch, inputs: StepInputs, draft_prefix: Optional[np.ndarray] = None) -> SamplingMetadata:
        """One row per logits row. Row r of sequence b samples output position
        len(output) + row_offset[r]; its penalty history includes the drafts before it
        (``row_prefixes``), and plugins may limit its tokens (``token_bitmask``: structured output)."""
        seqs = [batch.seqs[b] for b in inputs.row_seq]
        prefixes = self.row_prefixes(batch, inputs, draft_prefix)
        md = SamplingMetadata.build(
            params=[s.sampling_params for s in seqs],
            prompt_ids=[s.prompt_token_ids for s in seqs],
            output_ids=[s.output_token_ids + p if p else s.output_token_ids for s, p in zip(seqs, prefixes)],
            output_positions=[s.num_output_tokens + int(k) for s, k in zip(seqs, inputs.row_offset)],
            vocab_size=self.vocab_size,
            device=self.generator.device,
            eos_token_ids=self.eos_token_ids,
        )
        for plugin in self.plugins:
            limited = plugin.token_bitmask(batch, inputs, prefixes)
            if limited is not None:
                md.constrain(*limited)
        return md

    def _targets_in_step(self, batch: StepBatch, inputs: StepInputs) -> None:
        """Where some sequence samples and the step can sample for it: how each logits row
        samples, this step's draw included. A step that accepts inside (a drafter's hidden cache
        with rows to keep): sequence b's verification rows sample its output positions
        len(output) .. len(output) + counts[b]. A plain decode step (one row per sequence, every
        sequence sampling with temperature, top-k, top-p and a seed only, one dp rank): each
        sequence's next position (``inputs.extra["targets"]``)."""
        if all(s.sampling_params.plain_greedy for s in batch.seqs):
            return
        cache = inputs.extra.get("hidden_cache")
        if cache is not None:
            if cache.accepts_in_step:
                row_seq, row_offset = row_grid(cache.counts + 1)
                cache.targets = self._target_rows(batch, row_seq, row_offset)
            return
        if self._plain_step(batch, inputs) and all(samples_in_step(s.sampling_params) for s in batch.seqs):
            rows = np.arange(len(batch), dtype=np.int64)
            inputs.extra["targets"] = self._target_rows(batch, rows, np.zeros_like(rows))

    def _plain_step(self, batch: StepBatch, inputs: StepInputs) -> bool:
        """A decode step of one row per sequence, each its next token, on one dp rank."""
        return (not batch.is_prefill and not batch.is_mixed and inputs.sub_model_inputs is None
                and self.generator.dp_size == 1 and not any(p.needs_sampling_metadata for p in self.plugins)
                and bool((inputs.model_inputs.q_lens == 1).all())
                and len(inputs.model_inputs.lm_head_indices) == len(batch))

    def _target_rows(self, batch: StepBatch, row_seq: np.ndarray, row_offset: np.ndarray) -> TargetRows:
        seqs = [batch.seqs[b] for b in row_seq]
        return TargetRows.build([s.sampling_params for s in seqs],
                                [s.num_output_tokens + int(k) for s, k in zip(seqs, row_offset)],
                                self.vocab_size, self.sampler.step_key)

    def sample(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs) -> None:
        if self._plain_greedy(batch):  # the argmax, without the per-row metadata (~0.2 ms of host work a step)
            outputs.sampled = outputs.greedy_host()
            outputs.logprobs = None
            return
        cache = inputs.extra.get("hidden_cache")
        if cache is not None and cache.targets is not None:  # the step sampled its targets
            targets = outputs.greedy_host()  # read with the drafts and the accepted counts
            if accepted_in_step(inputs, outputs):
                outputs.sampled, outputs.logprobs = targets, None
                return
        if "targets" in inputs.extra and outputs.greedy_tokens is not None:  # a plain step sampled its tokens
            targets = outputs.greedy_host()
            if (targets >= 0).all():
                outputs.sampled, outputs.logprobs = targets, None
                return
        drafts = outputs.drafts_host()
        if drafts is None:  # drafts that were inputs, not outputs (a drafter without a model)
            drafts = inputs.extra.get("draft_prefix")
        md = self.sampling_metadata(batch, inputs, drafts)
        inputs.extra["sampling_metadata"] = md
        res = self.sampler(outputs.logits, md)
        outputs.sampled = res.token_ids.cpu().numpy()
        outputs.logprobs = None if res.logprobs is None else res.logprobs.cpu().numpy()
        if res.top_logprobs is not None:
            outputs.top_logprobs = (res.top_logprobs[0].cpu().numpy(), res.top_logprobs[1].cpu().numpy())

