"""StructuredOutputPlugin: every token of a request that asks for a format (JSON schema, regex,
EBNF grammar, choice) is drawn from logits masked to what the format allows next (MindIE's
``structured_output`` plugin, on xgrammar).

Each constrained sequence keeps a grammar matcher that has accepted its output so far (caught
up lazily from the sequence's tokens, so preemption, async scheduling's fill-in and a PD
hand-off need nothing else). Per step, ``token_bitmask`` gives every logits row of the
sequence the mask of the state after the drafts before that row: the matcher walks the drafts
(a tree's paths too), fills one mask per row, and rolls back. A draft the format refuses makes
the rows after it unreachable: the row before it samples from a mask without it, so no policy
that matches targets can keep it. ``plugin_verify`` still walks each sequence's accepted tokens
and cuts them at the first one the format refuses (relaxed and typical acceptance may keep a
draft the target does not rank first), taking that row's own target instead, which its mask
allowed.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mindspec.config.plugin_params import PluginParamsError
from mindspec.plugins.plugin import Plugin
from mindspec.text_generator.step import StepBatch, StepInputs, StepOutputs

from .draft_masks import DraftMasks, MaskTiming
from .grammars import GrammarCompilerCache
from .row_masks import accepted_prefix_length, fill_row_masks, full_bitmask

logger = logging.getLogger(__name__)

# plugin_params keys of this plugin (the engine keeps them from the other plugins' options)
OPTION_KEYS = ("mask_drafts",)


def parse_options(options: dict) -> dict:
    """plugin_params ``mask_drafts`` (default true): MTP draft steps draft under the format."""
    mask_drafts = options.get("mask_drafts", True)
    if not isinstance(mask_drafts, bool):
        raise PluginParamsError(f"plugin_params.mask_drafts must be true or false, got {mask_drafts!r}")
    return {"mask_drafts": mask_drafts}


@dataclass
class SeqGrammar:
    matcher: Any  # xgrammar.GrammarMatcher at the state after the first ``consumed`` output tokens
    consumed: int = 0


class StructuredOutputPlugin(Plugin):
    name = "structured_output"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], warm: bool = False,
                 mask_drafts: bool = True):
        self.tokenizer = tokenizer
        self.mask_drafts = mask_drafts
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._grammars: Optional[GrammarCompilerCache] = None
        self._loading = threading.Lock()
        self.states: dict[int, SeqGrammar] = {}
        self.timing = MaskTiming()
        if warm:
            self.grammars  # noqa: B018 (compile xgrammar's tokenizer tables at start-up)

    @property
    def grammars(self) -> GrammarCompilerCache:
        with self._loading:
            if self._grammars is None:
                self._grammars = GrammarCompilerCache(self.tokenizer.hf_tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def warm_in_background(self) -> None:
        """Load xgrammar and its tokenizer tables on a thread (a server: its first constrained
        request then does not hold up the steps of the others for seconds)."""
        threading.Thread(target=lambda: self.grammars, name="mindspec-xgrammar", daemon=True).start()

    def check(self, params) -> None:
        """Compile the request's format now (cached): a bad one is rejected at admission."""
        self.grammars.compile(params.structured)

    # ---- hooks ---------------------------------------------------------------------------------
    def model_inputs_update(self, batch: StepBatch, inputs: StepInputs) -> StepInputs:
        if self.mask_drafts and not batch.is_prefill and inputs.sub_model_inputs is not None:
            constrained = self._constrained(batch)
            if constrained:
                inputs.extra["draft_logits"] = DraftMasks(constrained, [batch.seqs[b] for b in constrained],
                                                          lambda seq: self._state(seq).matcher, self.vocab_size,
                                                          self.timing, num_rows=len(batch))
        return inputs

    def prepare_masks_for_filling(self, batch: StepBatch, inputs: StepInputs, pending) -> StepInputs:
        return self.model_inputs_update(batch, inputs)

    def token_bitmask(self, batch: StepBatch, inputs: StepInputs, row_prefix: list[list[int]]):
        constrained = self._constrained(batch)
        if not constrained:
            return None
        started = time.perf_counter()
        rows_of: dict[int, list[int]] = {b: [] for b in constrained}
        for r, b in enumerate(inputs.row_seq.tolist()):
            if b in rows_of:
                rows_of[b].append(r)
        rows = [r for b in constrained for r in rows_of[b]]
        bitmask = full_bitmask(len(rows), self.vocab_size)
        at = 0
        for b in constrained:
            state = self._state(batch.seqs[b])
            mine = rows_of[b]
            fill_row_masks(state.matcher, [row_prefix[r] for r in mine], bitmask, at)
            at += len(mine)
        self.timing.row_seconds += time.perf_counter() - started
        self.timing.steps += 1
        return bitmask, rows

    def plugin_verify(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs) -> StepOutputs:
        constrained = self._constrained(batch)
        if not constrained:
            return outputs
        started = time.perf_counter()
        for b in constrained:
            seq, tokens = batch.seqs[b], outputs.accepted[b]
            if not tokens:  # a prefill chunk before the prompt's last
                continue
            n = accepted_prefix_length(self._state(seq).matcher, tokens)
            if n < len(tokens):  # a kept draft the format refuses: its row's own target instead
                rows = outputs.accepted_rows[b]
                outputs.accepted[b] = tokens[:n] + [int(outputs.sampled[rows[n]])]
                outputs.accepted_rows[b] = rows[: n + 1]
                if outputs.num_draft_accepted is not None:
                    outputs.num_draft_accepted[b] = min(outputs.num_draft_accepted[b], n)
        self.timing.row_seconds += time.perf_counter() - started
        return outputs

    def plugin_cache_clear(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.states.pop(seq_id, None)

    # ---- matchers ------------------------------------------------------------------------------
    @staticmethod
    def _constrained(batch: StepBatch) -> list[int]:
        return [b for b, s in enumerate(batch.seqs) if s.sampling_params.has_structured]

    def _state(self, seq) -> SeqGrammar:
        """The sequence's matcher, caught up with its output tokens."""
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = SeqGrammar(self.grammars.matcher(seq.sampling_params.structured))
        output = seq.output_token_ids
        for token in output[state.consumed:]:
            if state.matcher.is_terminated():
                break
            if not state.matcher.accept_token(int(token)):
                # Only a token chosen without this plugin's mask can land here (a bug, or a prefill
                # node that did not constrain): say so; the rest stays constrained from the last
                # state the format accepted.
                logger.warning("structured output: sequence %d's token %d does not fit its format", seq.seq_id, token)
        state.consumed = len(output)
        return state

