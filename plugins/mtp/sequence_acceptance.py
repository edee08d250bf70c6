"""Per-sequence acceptance: what a sequence's own verified drafts say about its next ones.

One request's text may suit the MTP modules (boilerplate, code that repeats its prompt) and the
next one's may not; a pooled estimate lets either spoil the other. So each sequence keeps decayed
counts per draft position of drafts verified and accepted (as ``adaptive.Acceptance`` does for
the pool), and its estimate blends them with a prior: the mean acceptance of the last finished
sequences of its kind (greedy or sampled), each counted once, so one odd request moves a new
request's starting point by a sixteenth, not all the way.

A sequence whose estimate says drafting does not pay verifies none; after ``RETRY_AFTER`` steps
without drafts it retries one draft, and each retry after which its estimate still says no
doubles the wait, up to ``RETRY_MAX`` (= mtp_plugin.CATCH_UP: module 0 of the MTP caches is
caught up then anyway); a step in which it drafts by preference resets the wait.

Constants (benchmarks/README.md, "Per-sequence speculation control"):
- SEQ_DECAY 0.95: a sequence's estimate follows its text over ~20 speculative steps, and a
  sequence whose drafts are all kept reaches an estimate of 0.9 past the prior's 2 pseudo-drafts;
  a sequence whose drafts all miss stops drafting after 3-5 steps;
- PRIOR_SEQUENCES 16 finished sequences.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

SEQ_DECAY = 0.95  # weight kept by a sequence's past counts per speculative step
PRIOR_WEIGHT = 2.0  # pseudo-drafts of the prior at each position
PRIOR_SEQUENCES = 16  # finished sequences the prior averages, each with equal weight
RETRY_AFTER = 8  # steps without drafts before a sequence that stopped drafting retries one
RETRY_MAX = 32  # longest wait between two retries


def reached_and_kept(counts: np.ndarray, accepted: np.ndarray, max_k: int) -> tuple[np.ndarray, np.ndarray]:
    """counts [B] drafts each sequence verified, accepted [B] drafts it kept -> [B, max_k] bool
    per position j: the sequence reached draft j (verified it, every draft before it kept), and
    kept it."""
    j = np.arange(max_k)[None, :]
    counts, accepted = np.asarray(counts)[:, None], np.asarray(accepted)[:, None]
    reached = (j < counts) & (j <= accepted)
    return reached, reached & (j < accepted)


def expected_tokens(alpha: np.ndarray, reached: Optional[np.ndarray] = None) -> np.ndarray:
    """alpha [..., K] per-position acceptance -> [..., K + 1] tokens per step with k = 0..K drafts
    (``reached``: alpha's cumulative product, where the caller has it)."""
    reached = np.cumprod(alpha, axis=-1) if reached is None else reached
    zero = np.zeros(alpha.shape[:-1] + (1,))
    return 1.0 + np.concatenate([zero, np.cumsum(reached, axis=-1)], axis=-1)


def sequence_alphas(seqs: list["SequenceAcceptance"], prior: np.ndarray) -> np.ndarray:
    """[B, K] each sequence's estimate, its counts blended with ``prior`` ([K], or [B, K] per
    sequence). Positions a sequence has not reached would otherwise keep the prior for good (a
    sequence verifying one draft never learns about the second), so the prior it blends with at
    positions past the first is scaled by how its first position compares with the prior's: text
    easier than usual at draft 1 is easier further on too. One pass over the batch: a step asks
    this for every sequence."""
    verified = np.array([s.verified for s in seqs])  # [B, K]
    accepted = np.array([s.accepted for s in seqs])
    prior0 = prior[..., 0, None]  # [B, 1] or [1]
    first = (verified[:, :1] > 0) & (prior0 > 0)  # [B, 1]
    scale = np.where(first, accepted[:, :1] / np.where(first, verified[:, :1] * prior0, 1.0), 1.0)  # [B, 1]
    scaled = np.minimum(1.0, prior * scale)
    scaled[:, 0] = prior0[..., 0]
    return (accepted + PRIOR_WEIGHT * scaled) / (verified + PRIOR_WEIGHT)


class SequenceAcceptance:
    """One sequence's decayed counts per draft position, and its retry schedule."""

    def __init__(self, max_k: int, kind: Optional[str] = None):
        self.kind = kind  # which prior it starts from (adaptive.AdaptiveSpeculation.prior)
        self.verified = np.zeros(max_k)
        self.accepted = np.zeros(max_k)
        self.steps_without_drafts = 0
        self.retry_after = RETRY_AFTER
        self.prefers_drafts = True  # the controller's last judgement: its drafts pay

    def plain_step(self) -> None:
        """A step in which it verified no draft."""
        self.steps_without_drafts += 1

    def retry_due(self) -> bool:
        return self.steps_without_drafts >= self.retry_after

    def record(self, reached: np.ndarray, kept: np.ndarray) -> None:
        """One step: [K] bool, the positions it reached and those it kept (reached_and_kept's row;
        none reached: a step without drafts)."""
        if not reached[0]:
            self.plain_step()
            return
        if self.prefers_drafts:
            self.retry_after = RETRY_AFTER
        elif self.retry_due():  # a retry: if its estimate still says no drafts, the next one waits longer
            self.retry_after = min(2 * self.retry_after, RETRY_MAX)
        self.steps_without_drafts = 0
        # Only the positions reached decay: what a sequence learnt about a position it no longer
        # verifies stays until it verifies it again.
        self.verified = np.where(reached, SEQ_DECAY * self.verified + 1, self.verified)
        self.accepted = np.where(reached, SEQ_DECAY * self.accepted + kept, self.accepted)

    def own_alpha(self) -> np.ndarray:
        """[K] the sequence's own rates, NaN at positions it never reached."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.verified > 0, self.accepted / self.verified, np.nan)


class AcceptancePrior:
    """The starting estimate of a new sequence: per position, the mean of the last finished
    sequences' own rates (those that reached it); where none did, ``fallback``."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.finished: deque[np.ndarray] = deque(maxlen=PRIOR_SEQUENCES)
        self._mean: Optional[np.ndarray] = np.full(max_k, np.nan)  # None: recompute at the next read

    def add(self, seq: SequenceAcceptance) -> None:
        """Once per finished sequence; the mean is recomputed at the next read, so a step that
        finishes a whole batch (thousands of sequences) computes it once, not once per sequence."""
        if seq.verified[0] > 0:
            self.finished.append(seq.own_alpha())
            self._mean = None

    @property
    def mean(self) -> np.ndarray:
        """[K] per position, NaN where no finished sequence reached it."""
        if self._mean is None:
            rates = np.stack(self.finished)
            seen = (~np.isnan(rates)).sum(axis=0)
            with np.errstate(invalid="ignore"):
                self._mean = np.where(seen > 0, np.nansum(rates, axis=0) / np.maximum(seen, 1), np.nan)
        return self._mean

    def alpha(self, fallback: np.ndarray) -> np.ndarray:
        return np.where(np.isnan(self.mean), fallback, self.mean)
