"""SuffixPlugin: speculative decoding without draft weights (``"plugin_type": "suffix"``).

Each decode step drafts, per sequence, the tokens that followed the first earlier occurrence of
the longest suffix of its tokens that repeats (prompt and output; suffix_automaton.py), when that
suffix is at least ``min_match`` tokens long, at most ``num_speculative_tokens`` of them. Every
sequence verifies its own number of drafts (0 included) in one forward of the main model: rows
[last token, d1..dk] per sequence, every row an lm_head row (the graph runner pads unequal counts
per sequence). Acceptance is strict: the longest draft prefix equal to the sampled targets, then
the target after it, so greedy output is token for token what decoding without drafts gives, and
sampled output has the target's distribution. Works on any checkpoint (no MTP modules needed).

Under async scheduling the drafts are made when the previous step's tokens are known, right
before the step runs (fill_in_model_result). Not yet: other decoding policies.
With MTP, suffix drafts are the MTP plugin's ``suffix_drafting`` option (``"mtp,suffix"``).
"""
from __future__ import annotations

import numpy as np

from mindspec.config.plugin_params import PluginParamsError
from mindspec.modeling.forward_metadata import build_model_inputs, row_grid
from mindspec.plugins.plugin import Plugin
from mindspec.text_generator.step import StepBatch, StepInputs, StepOutputs, draft_grid

from .sequence_drafts import SuffixDrafts, matched_prefix

MAX_DRAFTS = 15  # the graph runner's rows per sequence (MAX_VERIFY_ROWS) less the fed token
KNOWN_KEYS = {"num_speculative_tokens", "min_match", "decoding_policy"}


def _int_option(options: dict, key: str, lo: int, hi: int, default: int) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise PluginParamsError(f"plugin_params.{key} must be an integer in {lo}..{hi} for plugin_type 'suffix', "
                                f"got {value!r}")
    return value


class SuffixPlugin(Plugin):
    name = "suffix"

    def __init__(self, generator, cache_config, **options):
        unknown = sorted(set(options) - KNOWN_KEYS)
        if unknown:
            raise PluginParamsError(f"plugin_params.{unknown[0]} is not a suffix option (known: {', '.join(sorted(KNOWN_KEYS))})")
        if options.get("decoding_policy", "strict") != "strict":
            raise PluginParamsError(f"plugin_params.decoding_policy must be 'strict' for plugin_type 'suffix', "
                                    f"got {options['decoding_policy']!r}")
        max_drafts = _int_option(options, "num_speculative_tokens", 1, MAX_DRAFTS, 4)
        self.drafts = SuffixDrafts(max_drafts, _int_option(options, "min_match", 1, 1024, 3))
        self.num_lookahead_tokens = max_drafts
        self.block_size = cache_config.block_size

    # ---- hooks ---------------------------------------------------------------------------------
    def model_inputs_update(self, batch: StepBatch, inputs: StepInputs) -> StepInputs:
        if batch.is_prefill or batch.is_mixed:  # a SplitFuse step drafts nothing
            return inputs
        drafts = [self.drafts.draft(seq) for seq in batch.seqs]
        if not any(drafts):
            return inputs  # a plain decode step
        return self._verify_inputs(batch, inputs, drafts)

    def prepare_masks_for_filling(self, batch: StepBatch, inputs: StepInputs, pending: np.ndarray) -> StepInputs:
        """Async scheduling: the drafts follow the tokens of the step still running, so they are
        made in fill_in_model_result; nothing is drafted from placeholders."""
        return inputs

    def fill_in_model_result(self, batch: StepBatch, inputs: StepInputs, pending: np.ndarray,
                             accepted: list[list[int]]) -> None:
        """The views hold the real tokens now: draft, and lay the step out from them (rows and
        positions, whatever the previous step accepted)."""
        if batch.is_prefill or batch.is_mixed:
            return
        self._verify_inputs(batch, inputs, [self.drafts.draft(seq) for seq in batch.seqs])

    def _verify_inputs(self, batch: StepBatch, inputs: StepInputs, drafts: list[list[int]]) -> StepInputs:
        """Rows [last token, d1..dk] per sequence (k = 0 included), every row an lm_head row."""
        counts = np.array([len(d) for d in drafts], dtype=np.int64)
        rows = [[seq.last_token_id, *d] for seq, d in zip(batch.seqs, drafts)]
        inputs.model_inputs = build_model_inputs(
            rows, [seq.num_tokens - 1 for seq in batch.seqs], [seq.block_table for seq in batch.seqs],
            self.block_size, lm_head_indices=np.arange(int(counts.sum()) + len(rows), dtype=np.int64),
        )
        inputs.q_lens = inputs.model_inputs.q_lens
        inputs.row_seq, inputs.row_offset = row_grid(counts + 1)
        inputs.extra["suffix_drafts"] = drafts
        inputs.extra["draft_prefix"] = draft_grid(drafts)  # row k's penalty history: the drafts before it
        return inputs

    def plugin_verify(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs) -> StepOutputs:
        drafts = inputs.extra.get("suffix_drafts")
        if drafts is None:
            return outputs
        accepted, accepted_rows, num_accepted = [], [], []
        start = 0
        for d in drafts:
            targets = outputs.sampled[start : start + len(d) + 1]
            n = matched_prefix(d, targets)
            accepted.append([int(t) for t in targets[: n + 1]])
            accepted_rows.append(list(range(start, start + n + 1)))
            num_accepted.append(n)
            start += len(d) + 1
        outputs.accepted, outputs.accepted_rows = accepted, accepted_rows
        outputs.num_draft_accepted = num_accepted
        outputs.num_drafts = [len(d) for d in drafts]
        return outputs

    def plugin_cache_clear(self, seq_ids: list[int]) -> None:
        self.drafts.clear(seq_ids)
