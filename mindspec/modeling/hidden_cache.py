"""The drafter's hidden-state cache read, and strict acceptance with the accepted rows' hidden
states kept, as tensor ops inside a speculative step.

A chain speculative step feeds its first draft stage main-model hidden states kept from earlier
steps (MTP's hidden history, plugins/mtp/hidden_history.py: one buffer [R, hidden] whose row 0
stays zero), and after verification keeps the hidden states of the positions it accepted. Done
on the host, that is a gather before the step, and after it the argmax read back, acceptance in
numpy and a scatter: device ops, index copies and a synchronisation outside the compiled step or
captured graph. Here the host only says which rows: the gather, the argmax, strict greedy
acceptance and the scatter run inside the step (the cpu package, the CUDA graph, or eagerly), and
the host reads the targets, the drafts and the accepted counts back together.

Acceptance inside the step is strict (decoding_policy.strict_accept): draft j + 1 is kept while
it equals the target at the sequence's row j. Where every sequence is plain greedy the target is
the row's argmax; where some sample with temperature, top-k, top-p and a seed only, the step
takes each row's sampling inputs and samples the targets itself (``TargetRows``,
sampling/step_targets.py), and reports a step whose top-p sets it cannot decide (accepted -1: the
host samples, accepts and keeps instead). Other requests and policies run the same step (one
package or graph per shape) with no row to keep, and accept and keep on the host after the
sampler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from mindspec.backend import Backend, IndexedRows, accept_drafts
from mindspec.text_generator.sampling.step_targets import TargetRows, sample_targets


@dataclass
class HiddenCacheRows:
    """Which rows of the hidden cache a speculative step reads and may write (host arrays)."""

    buffer: torch.Tensor  # [R, hidden] on the device; row 0 is zero
    read_rows: np.ndarray  # [sub rows] int64: the cache row feeding each first-stage row (0: zeros)
    counts: np.ndarray  # [B] int64 drafts each sequence verifies
    # [B, K + 1] int64: where verification row j of sequence b's hidden state goes when the step
    # accepts it (0: nowhere; all 0 when acceptance and keeping happen on the host)
    keep_rows: np.ndarray
    # how each verification row samples its target when some sequence samples (None: argmax);
    # filled in by the plugin manager, which holds the sampler's draws
    targets: Optional[TargetRows] = None

    @property
    def accepts_in_step(self) -> bool:
        """The step's acceptance is the step's: it has rows to keep (every real row is >= 1)."""
        return bool(self.keep_rows.any())

    def gathered(self) -> torch.Tensor:
        """[sub rows, hidden] the first stage's hidden states, gathered now (paths that take
        them as a tensor: dp shards; acceptance then stays on the host)."""
        index = torch.from_numpy(np.ascontiguousarray(self.read_rows, dtype=np.int64)).to(self.buffer.device)
        return IndexedRows(self.buffer, index).materialize()


@dataclass
class HiddenKeep:
    """Where a plain decode step (one row per sequence) keeps its hidden states in the drafter's
    hidden cache, inside the step (Backend ``keep_hidden_rows``) rather than by a write after it."""

    buffer: torch.Tensor  # [R, hidden] on the device; row 0 is zero
    rows: np.ndarray  # [B] int64 cache row of each sequence's hidden state (0: none)


@dataclass
class DeviceHiddenCache:
    """``HiddenCacheRows`` on the device, as a step takes it."""

    buffer: torch.Tensor  # [R, hidden]
    read_rows: torch.Tensor  # [sub rows] int64
    starts: torch.Tensor  # [B] int64 first verification row of each sequence
    counts: torch.Tensor  # [B] int64
    keep_rows: torch.Tensor  # [B, K + 1] int64
    targets: Optional[list[torch.Tensor]] = None  # TargetRows.arrays() on the device

    @staticmethod
    def of(buffer: torch.Tensor, arrays: list[torch.Tensor]) -> "DeviceHiddenCache":
        """From ``device_rows``' arrays as device tensors (keep rows flat: reshaped here)."""
        read, starts, counts, keep, *targets = arrays
        return DeviceHiddenCache(buffer, read, starts, counts, keep.view(starts.shape[0], -1), targets or None)

    def tensors(self) -> list[torch.Tensor]:
        """The buffer, then ``device_rows``' arrays (a package's inputs)."""
        return [self.buffer, self.read_rows, self.starts, self.counts, self.keep_rows.reshape(-1), *(self.targets or [])]


def speculative_step(forward: Callable, cache: DeviceHiddenCache, whole_rows: bool = False,
                     backend: Optional[Backend] = None):
    """``forward(first-stage hidden states)`` -> ModelOutput of a speculative step, its hidden
    states the rows of ``cache`` (``IndexedRows``: the first stage's eh_proj reads them), its
    targets and accepted drafts computed and the accepted rows' hidden states kept
    (``greedy_tokens``: the targets, ``accepted_drafts``; with keep rows all 0 nothing is kept
    and the host accepts). ``whole_rows``: as step_targets.sample_targets'.
    ``backend``: whose ``accept_and_pack`` runs (None: the tensor ops)."""
    out = forward(IndexedRows(cache.buffer, cache.read_rows))  # gathered by the first stage's eh_proj
    out.greedy_tokens, out.draft_tokens, out.accepted_drafts = accept_and_keep(
        cache.buffer, out.logits, out.hidden_states, out.draft_tokens, cache.starts, cache.counts, cache.keep_rows,
        cache.targets, whole_rows, backend)
    return out


def accept_and_keep(
    buffer: torch.Tensor,  # [R, hidden] the hidden cache, written in place
    logits: torch.Tensor,  # [N, vocab] every verification row's
    hidden: torch.Tensor,  # [N, hidden] the main model's hidden states of the same rows
    drafts: torch.Tensor,  # [B, K]
    starts: torch.Tensor,  # [B] int64 each sequence's first verification row
    counts: torch.Tensor,  # [B] int64 drafts each sequence verifies (<= K; 0 for padding sequences)
    keep_rows: torch.Tensor,  # [B, K + 1] int64 cache row of each verification row's position (0: none)
    sampling: Optional[list[torch.Tensor]] = None,  # TargetRows.arrays() on the device; None: greedy
    whole_rows: bool = False,  # as step_targets.sample_targets'
    backend: Optional[Backend] = None,  # whose accept_and_pack runs (None: the tensor ops)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Strict acceptance -> (targets [N]: each row's argmax, or its sample with ``sampling``;
    the drafts [B, K]; accepted drafts [B]: a backend may return the three packed in one buffer,
    Backend.accept_and_pack); the hidden states of each sequence's accepted rows (its first
    accepted + 1) go to their cache rows. A sampled step whose targets are not the sampler's
    (step_targets.sample_targets' ``exact``) keeps nothing and accepts -1 drafts for every
    sequence."""
    if sampling is None:
        targets, exact = logits.argmax(dim=-1), None  # [N]
    else:
        targets, exact = sample_targets(logits, *sampling, whole_rows=whole_rows)
    if backend is None:
        return targets, drafts, accept_drafts(buffer, targets, exact, hidden, drafts, starts, counts, keep_rows)
    return backend.accept_and_pack(buffer, targets, exact, hidden, drafts, starts, counts, keep_rows)


def device_rows(cache: HiddenCacheRows, starts: np.ndarray) -> list[np.ndarray]:
    """The arrays a step takes for ``cache`` besides the buffer, in its order: read rows, starts
    [B], counts [B], keep rows [B, K + 1] flattened (int64), then the target rows' arrays."""
    rows = [np.ascontiguousarray(a, dtype=np.int64).reshape(-1)
            for a in (cache.read_rows, starts, cache.counts, cache.keep_rows)]
    return rows + ([] if cache.targets is None else [np.ascontiguousarray(a) for a in cache.targets.arrays()])
