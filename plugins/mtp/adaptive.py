"""Adaptive speculation: per decode step, how many drafts to verify (0: a plain step), from
measured throughput.

Speculation pays when a step that verifies k+1 tokens per sequence costs less than the tokens it
yields. At batch 1 that holds easily (a step is dispatch- or bandwidth-bound, so k+1 tokens cost
little more than one); at large batches the step becomes compute-bound, every extra token costs
nearly as much as a real one, and rejected drafts are pure loss (users of vLLM and SGLang report
speculation turning into a slowdown there), while fewer drafts, whose acceptance is highest, may
still pay. So the choice is measured, not assumed. Tokens per step come from the measured acceptance: per
draft position j, the share of drafts at j accepted when every draft before it was (decayed
counts over recent speculative steps of every batch size and draft count), so a step with k
drafts yields 1 + sum_{j<=k} prod_{i<=j} alpha_i tokens per sequence; every speculative step
informs every arm that drafts as far, where per-arm means of a few exploration steps swing with
the text being written (a run of boilerplate or of novel code). Step time is measured per
batch-size bucket and draft count (the "arms"), as the median of its recent steps. The controller
picks the arm with the most tokens per second. Each arm is timed a few times first, and the arms
not chosen are re-tried now and then (a few steps in a row, one arm at a time), so the estimate
follows the context length as it changes. Speculative steps that catch up MTP cache entries
skipped by plain steps are not measured: they cost more than a steady speculative step, and
counting them would make speculation look worse the longer it is off.

Every choice is lossless: a step without drafts is plain decoding, and the MTP caches it skipped
are caught up by the next speculative step (decode_inputs: ``last_accepted`` counts the entries
still to write).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

MIN_SAMPLES = 3  # steps of each arm measured in a bucket before choosing by throughput
WINDOW = 16  # recent steps per arm that the estimate uses
REEXPLORE_EVERY = 64  # steps in a bucket between two tries of an arm not chosen
REEXPLORE_BURST = 3  # steps per try: the first speculative one after plain steps catches up, unmeasured
MARGIN = 0.03  # switch only when another arm is this much faster (no flip-flopping on noise)
DECAY = 0.98  # weight kept by past acceptance counts per speculative step (~50 steps remembered)


def batch_bucket(batch_size: int) -> int:
    """Smallest power of two >= batch_size."""
    return 1 << max(0, batch_size - 1).bit_length()


class Acceptance:
    """Per draft position, decayed counts of drafts verified and accepted when every draft
    before them was accepted: alpha_j = accepted_j / verified_j."""

    def __init__(self, max_k: int):
        self.verified = np.zeros(max_k)
        self.accepted = np.zeros(max_k)

    def record(self, k: int, accepted: Sequence[int]) -> None:
        """One step with k drafts per sequence; accepted[b]: drafts sequence b kept (0..k)."""
        a = np.asarray(accepted)[:, None]
        positions = np.arange(k)[None, :]
        self.verified *= DECAY
        self.accepted *= DECAY
        self.verified[:k] += (positions <= a).sum(axis=0)  # reached: every draft before was kept
        self.accepted[:k] += (positions < a).sum(axis=0)

    def expected_tokens(self) -> np.ndarray:
        """[max_k + 1]: expected tokens per sequence from a step with k = 0..max_k drafts."""
        alpha = np.divide(self.accepted, self.verified, out=np.zeros_like(self.verified), where=self.verified > 0)
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(alpha))])

    def tokens(self, k: int) -> float:
        return float(self.expected_tokens()[k])


@dataclass
class _Bucket:
    choice: int  # drafts per step now chosen
    seconds: dict[int, deque] = field(default_factory=dict)  # arm -> recent step times
    steps: int = 0

    def median_seconds(self, k: int) -> float:
        """A step slowed by something else on the machine (a noisy neighbour, a page fault, GC)
        moves a median little and a mean a lot."""
        s = self.seconds.get(k, ())
        return statistics.median(s) if s else 0.0


class AdaptiveSpeculation:
    """Decides, per step, how many drafts a batch of ``batch_size`` sequences verifies.

    ``arms``: the allowed draft counts, the largest the plugin's K (0 = a plain step)."""

    def __init__(self, arms: Sequence[int], enabled: bool = True):
        if not arms or min(arms) < 0:
            raise ValueError(f"adaptive speculation needs draft counts >= 0, got {list(arms)}")
        self.arms = sorted(set(arms), reverse=True)  # the most speculative first: explored first
        self.max_k = self.arms[0]
        self.enabled = enabled
        self.buckets: dict[int, _Bucket] = {}
        self.acceptance = Acceptance(self.max_k)

    def reset(self) -> None:
        """Forget every measurement (warm-up steps on dummy prompts are no sample of serving)."""
        self.buckets.clear()
        self.acceptance = Acceptance(self.max_k)

    def _bucket(self, batch_size: int) -> _Bucket:
        key = batch_bucket(batch_size)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(choice=self.max_k, seconds={k: deque(maxlen=WINDOW) for k in self.arms})
        return b

    def choose(self, batch_size: int) -> int:
        if not self.enabled or len(self.arms) == 1:
            return self.max_k
        b = self._bucket(batch_size)
        b.steps += 1
        fewest = min(self.arms, key=lambda k: len(b.seconds[k]))  # ties: the most speculative
        if len(b.seconds[fewest]) < MIN_SAMPLES:
            return fewest  # explore, round robin over the arms
        if b.steps % REEXPLORE_EVERY < REEXPLORE_BURST:
            others = [k for k in self.arms if k != b.choice]
            return others[(b.steps // REEXPLORE_EVERY) % len(others)]
        tokens = self.acceptance.expected_tokens()  # once per decision, shared by the arms
        rate = {k: self._rate(b, k, tokens) for k in self.arms}
        best = max(self.arms, key=rate.get)
        if best != b.choice and rate[best] > rate[b.choice] * (1 + MARGIN):
            b.choice = best
        return b.choice

    def planned(self, batch_size: int) -> int:
        """The draft count steps of this batch size currently get (K until measured; no side
        effects: a prefill asks this to decide which MTP caches its prompts need)."""
        b = self.buckets.get(batch_bucket(batch_size))
        return b.choice if self.enabled and b is not None else self.max_k

    def record(self, batch_size: int, k: int, accepted: Sequence[int], seconds: float) -> None:
        """One finished step with ``k`` drafts: the drafts each sequence kept, and its wall time."""
        if not self.enabled or seconds <= 0 or k not in self.arms:
            return
        self._bucket(batch_size).seconds[k].append(seconds)
        if k > 0 and len(accepted):
            self.acceptance.record(k, accepted)

    def throughput(self, batch_size: int, k: int) -> float:
        """Expected tokens per sequence per second of a step with k drafts at this batch size."""
        return self._rate(self.buckets[batch_bucket(batch_size)], k, self.acceptance.expected_tokens())

    @staticmethod
    def _rate(b: _Bucket, k: int, tokens: np.ndarray) -> float:
        seconds = b.median_seconds(k)
        return float(tokens[k]) / seconds if seconds > 0 else 0.0

    def summary(self) -> dict:
        """Per bucket: the draft count now chosen and each arm's tokens per sequence per second."""
        tokens = self.acceptance.expected_tokens()
        return {
            bucket: {"k": b.choice, "tokens_per_s": {k: round(self._rate(b, k, tokens), 2) for k in self.arms}}
            for bucket, b in sorted(self.buckets.items())
        }
