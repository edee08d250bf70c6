"""Drafts under the format: between MTP draft steps, each constrained sequence's next draft is
taken from logits masked to what the format allows after the drafts before it. Drafts the
format refuses could never be accepted (their verification row samples under the mask), so
on constrained text unmasked drafts mostly fail; masked ones follow the format's forced tokens
(quotes, keys, brackets) and are kept as often as on free text.

Each draft step costs one device-to-host copy of the step's drafts and a walk of the matchers;
steps with masks run eagerly (not from captured graphs). With dp, each rank masks its own
sequences' draft rows (``local``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from mindspec.text_generator.sampling.sampler import mask_rows_

from .row_masks import fill_row_masks, full_bitmask


@dataclass
class MaskTiming:
    """Host time structured output added to the steps (benchmarks read it)."""

    row_seconds: float = 0.0  # verification rows' masks and the walk of accepted tokens
    draft_seconds: float = 0.0  # draft steps' masks, device-to-host copies included
    steps: int = 0  # steps with a constrained sequence


class DraftMasks:
    """``flash_causal_deepseekv2.DraftLogits`` for one step: draft logits row ``rows[i]`` takes the
    mask of ``seqs[i]``'s matcher (``matcher_of(seq)``: caught up with the sequence's accepted
    output when the drafter calls, after any async fill-in)."""

    def __init__(self, rows: list[int], seqs: list, matcher_of: Callable, vocab_size: int, timing: MaskTiming,
                 num_rows: Optional[int] = None):
        self.rows = rows
        self.seqs = seqs
        self.matcher_of = matcher_of
        self.vocab_size = vocab_size
        self.timing = timing
        self.num_rows = num_rows  # the draft batch's rows, when known (a mixed step's differ: left alone)
        self._index = None

    def local(self, seqs: np.ndarray) -> Optional["DraftMasks"]:
        """The masks of a dp rank whose draft rows are the batch's sequences ``seqs`` (then padding)."""
        where = {int(b): i for i, b in enumerate(seqs)}
        mine = [(where[b], s) for b, s in zip(self.rows, self.seqs) if b in where]
        if not mine:
            return None
        return DraftMasks([r for r, _ in mine], [s for _, s in mine], self.matcher_of, self.vocab_size, self.timing)

    def __call__(self, logits: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        if self.num_rows is not None and logits.shape[0] != self.num_rows:
            return logits
        started = time.perf_counter()
        before = torch.stack(drafts, dim=1).cpu()[self.rows].tolist() if drafts else [[]] * len(self.rows)
        bitmask = full_bitmask(len(self.rows), self.vocab_size)
        for i, (seq, prefix) in enumerate(zip(self.seqs, before)):
            fill_row_masks(self.matcher_of(seq), [prefix], bitmask, i)
        if self._index is None:
            self._index = torch.tensor(self.rows, dtype=torch.int64, device=logits.device)
        out = logits.clone()
        mask_rows_(out, self._index, bitmask.to(logits.device))
        self.timing.draft_seconds += time.perf_counter() - started
        return out
