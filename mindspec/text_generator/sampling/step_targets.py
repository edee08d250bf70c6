"""Target tokens sampled inside a speculative step, so that sampled requests accept inside it too.

Strict verification samples a target at every verification row and keeps each draft while it
equals the target before it (plugins/mtp/decoding_policy.py). For rows that ask for temperature,
top-k, top-p and a seed and nothing else (``samples_in_step``) the sampler's pipeline is tensor
ops with static shapes: the step takes each row's temperature, top-k, top-p and noise key as
inputs (``TargetRows``, built on the host before the step) and computes the targets itself
(``sample_targets``), the same ops as the host sampler, so eagerly its tokens are the sampler's.

A plain decode step samples its rows' tokens the same way (``decided_targets``). One part is
not static: the sampler's top-p threshold is decided from the row's 256 largest logits unless the
row's top-p mass reaches past them (or its top-k is wider), when it does the row again over the
whole vocabulary. A step on a backend whose steps are not captured graphs does the same
(``whole_rows``: a branch on the step's own values, ``torch.cond`` in compiled code, so the sort
of the whole vocabulary costs only the steps that need it). A captured graph (CUDA, NPU) cannot
branch, so there the step reports such a row instead (``exact`` False): a speculative step then
keeps nothing, a plain one returns -1 targets, and the host samples (and accepts) that step as
it does for every other request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .noise import exponential_noise, row_keys
from .params import SamplingParams
from .sampler import RANK_CANDIDATES, threshold_over_head


def samples_in_step(params: SamplingParams) -> bool:
    """The row's target can be sampled inside a step: temperature, top-k, top-p and the seed are
    all it asks (no penalty, bias, min_tokens ban, min-p, typical-p, format or logprobs)."""
    return params.tokens_only and params.min_p == 0.0 and params.typical_p >= 1.0


@dataclass
class TargetRows:
    """How each logits row of a step samples its target (host arrays, one entry per row)."""

    temperature: np.ndarray  # [N] float32; 0: greedy (the row's argmax)
    top_k: np.ndarray  # [N] int64; the vocabulary size: off
    top_p: np.ndarray  # [N] float32; 1: off
    keys: np.ndarray  # [N] int64 this step's noise keys (noise.row_keys, unseeded rows offset by the step's draw)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], output_positions: Sequence[int], vocab_size: int,
              step_key: Callable[[], int]) -> "TargetRows":
        """Row r samples output position ``output_positions[r]`` as ``params[r]`` says;
        ``step_key`` is called once when some sampled row has no seed (the host sampler's draw)."""
        greedy = [p.greedy for p in params]
        seeds = [-1 if p.seed is None else p.seed for p in params]
        keys = row_keys(seeds, output_positions)
        if any(not g and s < 0 for g, s in zip(greedy, seeds)):
            unseeded = np.array([s < 0 for s in seeds])
            # int64 addition wrapping modulo 2**64, as noise.keyed_for_step's on the device
            stepped = (keys.view(np.uint64) + np.uint64(step_key() & (2**64 - 1))).view(np.int64)
            keys = np.where(unseeded, stepped, keys)
        return cls(
            temperature=np.array([0.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=np.float32),
            top_k=np.array([vocab_size if p.top_k <= 0 or p.top_k >= vocab_size else p.top_k for p in params],
                           dtype=np.int64),
            top_p=np.array([p.top_p for p in params], dtype=np.float32),
            keys=keys,
        )

    def arrays(self) -> list[np.ndarray]:
        """A step's inputs, in ``sample_targets``' order."""
        return [self.temperature, self.top_k, self.top_p, self.keys]

    def padded(self, rows: int, row_map: Optional[np.ndarray], vocab_size: int) -> "TargetRows":
        """The rows of a step padded to ``rows`` logits rows (``row_map``: each real row's padded
        row; None: the real rows first): padding rows are greedy."""
        index = np.arange(len(self.keys)) if row_map is None else row_map

        def spread(values: np.ndarray, fill) -> np.ndarray:
            out = np.full(rows, fill, dtype=values.dtype)
            out[index] = values
            return out

        return TargetRows(spread(self.temperature, 0.0), spread(self.top_k, vocab_size), spread(self.top_p, 1.0),
                          spread(self.keys, 0))


def sample_targets(
    logits: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N] float32, 0: greedy
    top_k: torch.Tensor,  # [N] int64, V: off
    top_p: torch.Tensor,  # [N] float32, 1: off
    keys: torch.Tensor,  # [N] int64 noise keys
    whole_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (targets [N] int64, exact [] bool). Sampled rows: the exponential race over the
    temperature-scaled, top-k / top-p filtered softmax (the host sampler's ops); greedy rows the
    argmax. A sampled row whose top-k or top-p set may reach past the ``RANK_CANDIDATES`` largest
    logits takes its threshold from its whole row with ``whole_rows`` (as the sampler does);
    without, ``exact`` is False and its target is not the sampler's."""
    v = logits.shape[1]
    greedy = temperature == 0  # [N]
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    width = min(v, RANK_CANDIDATES)
    thr, short = threshold_over_head(scaled, top_k, top_p, width)  # [N, 1], [N]
    wide = (top_k > width) & (top_k < v)  # a top-k the head cannot hold
    past = (short | wide) & ~greedy  # [N] rows the head cannot decide
    exact = ~past.any()
    if whole_rows and width < v:
        # copies: a package's inputs may be views of one buffer, and cond's operands may not alias
        whole = _branch(~exact, _whole_row_thresholds, _unused_thresholds, (scaled, top_k.clone(), top_p.clone()))
        thr = torch.where(past.unsqueeze(1), whole, thr)
        exact = torch.ones_like(exact)
    keep = scaled >= thr
    probs = scaled.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # [N, V]
    sampled = (probs / exponential_noise(keys, v)).argmax(dim=-1)  # [N]
    targets = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return targets, exact


def _whole_row_thresholds(scaled, top_k, top_p) -> torch.Tensor:
    return threshold_over_head(scaled, top_k, top_p, scaled.shape[1])[0]  # [N, 1]


def _unused_thresholds(scaled, top_k, top_p) -> torch.Tensor:
    return scaled.new_zeros(scaled.shape[0], 1)  # no row takes them (a new tensor: a cond branch may not alias)


def _branch(pred: torch.Tensor, true_fn: Callable, false_fn: Callable, operands: tuple) -> torch.Tensor:
    """``torch.cond`` where the step is traced (a package keeps both branches); eagerly a plain
    ``if`` (torch.cond would compile its branches)."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, true_fn, false_fn, operands)
    return true_fn(*operands) if bool(pred) else false_fn(*operands)


def decided_targets(logits: torch.Tensor, sampling: Sequence[torch.Tensor], whole_rows: bool = False) -> torch.Tensor:
    """[N] int64 each row's target (``sample_targets`` over ``TargetRows.arrays()`` on the
    device), or -1 in every row when the step cannot decide them all (the host samples then)."""
    targets, exact = sample_targets(logits, *sampling, whole_rows=whole_rows)
    return torch.where(exact, targets, torch.full_like(targets, -1))
