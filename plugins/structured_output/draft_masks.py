"""Drafts under the format: between MTP draft steps, each constrained sequence's next draft is
taken from logits masked to what the format allows after the drafts before it. Drafts the
format refuses could never be accepted (their verification row samples under the mask), so
on constrained text unmasked drafts mostly fail; masked ones follow the format's forced tokens
(quotes, keys, brackets) and are kept as often as on free text.

Each draft step costs one device-to-host copy of the step's drafts and a walk of the matchers;
steps with masks run eagerly (not from captured graphs).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mindspec.text_generator.sampling.sampler import unpack_bitmask

from .row_masks import fill_row_masks


@dataclass
class MaskTiming:
    """Host time structured output added to the steps (benchmarks read it)."""

    row_seconds: float = 0.0  # verification rows' masks and the walk of accepted tokens
    draft_seconds: float = 0.0  # draft steps' masks, device-to-host copies included
    steps: int = 0  # steps with a constrained sequence


class DraftMasks:
    """``flash_causal_deepseekv2.DraftLogits`` for one step: rows ``constrained`` of the draft
    logits [B, V] take the masks of their sequences' matchers (``matchers[i]`` for row
    ``constrained[i]``, at the state after the sequence's accepted output)."""

    def __init__(self, constrained: list[int], matchers, vocab_size: int, num_seqs: int, timing: MaskTiming):
        self.constrained = constrained
        self.timing = timing
        self.matchers = matchers
        self.vocab_size = vocab_size
        self.num_seqs = num_seqs
        self._rows = None

    def __call__(self, logits: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        if logits.shape[0] != self.num_seqs:  # not one row per sequence (a mixed step): leave them
            return logits
        started = time.perf_counter()
        before = torch.stack(drafts, dim=1).cpu()[self.constrained].tolist() if drafts else [[]] * len(self.constrained)
        bitmask = torch.full((len(self.constrained), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for i, (matcher, prefix) in enumerate(zip(self.matchers, before)):
            fill_row_masks(matcher, [prefix], bitmask, i)
        if self._rows is None:
            self._rows = torch.tensor(self.constrained, dtype=torch.int64, device=logits.device)
        allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
        out = logits.clone()
        out.index_copy_(0, self._rows, out.index_select(0, self._rows).masked_fill_(~allowed, float("-inf")))
        self.timing.draft_seconds += time.perf_counter() - started
        return out
