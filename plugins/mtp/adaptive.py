"""Adaptive speculation: per decode step, how many drafts to verify (0: a plain step), from
measured throughput.

Speculation pays when a step that verifies k+1 tokens per sequence costs less than the tokens it
yields. At batch 1 that holds easily (a step is dispatch- or bandwidth-bound, so k+1 tokens cost
little more than one); at large batches the step becomes compute-bound, every extra token costs
nearly as much as a real one, and rejected drafts are pure loss (users of vLLM and SGLang report
speculation turning into a slowdown there), while fewer drafts, whose acceptance is highest, may
still pay. So the choice is measured, not assumed: for each batch-size bucket the controller keeps
the recent steps of every allowed draft count (its "arms"), as (tokens yielded per sequence,
seconds), and picks the arm with the most tokens per second (mean tokens over median seconds).
Each arm is tried a few times first, and the arms not chosen are re-tried now and then (a few
steps in a row, one arm at a time), so the estimate follows the acceptance rate and the context length as they change. Speculative steps
that catch up MTP cache entries skipped by plain steps are not measured: they cost more than a
steady speculative step, and counting them would make speculation look worse the longer it is off.

Every choice is lossless: a step without drafts is plain decoding, and the MTP caches it skipped
are caught up by the next speculative step (decode_inputs: ``last_accepted`` counts the entries
still to write).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

MIN_SAMPLES = 3  # steps of each arm measured in a bucket before choosing by throughput
WINDOW = 16  # recent steps per arm that the estimate uses
REEXPLORE_EVERY = 64  # steps in a bucket between two tries of an arm not chosen
REEXPLORE_BURST = 3  # steps per try: the first speculative one after plain steps catches up, unmeasured
MARGIN = 0.03  # switch only when another arm is this much faster (no flip-flopping on noise)


def batch_bucket(batch_size: int) -> int:
    """Smallest power of two >= batch_size."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class _Bucket:
    choice: int  # drafts per step now chosen
    samples: dict[int, deque] = field(default_factory=dict)  # arm -> deque[(tokens, seconds)]
    steps: int = 0

    def throughput(self, k: int) -> float:
        """Mean tokens over the median step time: a step slowed by something else on the machine
        (a noisy neighbour, a page fault, GC) moves a median little and a sum a lot."""
        s = self.samples.get(k, ())
        seconds = statistics.median(t for _, t in s) if s else 0.0
        return statistics.fmean(n for n, _ in s) / seconds if seconds > 0 else 0.0


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

    def _bucket(self, batch_size: int) -> _Bucket:
        key = batch_bucket(batch_size)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(choice=self.max_k, samples={k: deque(maxlen=WINDOW) for k in self.arms})
        return b

    def choose(self, batch_size: int) -> int:
        if not self.enabled or len(self.arms) == 1:
            return self.max_k
        b = self._bucket(batch_size)
        b.steps += 1
        fewest = min(self.arms, key=lambda k: len(b.samples[k]))  # ties: the most speculative
        if len(b.samples[fewest]) < MIN_SAMPLES:
            return fewest  # explore, round robin over the arms
        if b.steps % REEXPLORE_EVERY < REEXPLORE_BURST:
            others = [k for k in self.arms if k != b.choice]
            return others[(b.steps // REEXPLORE_EVERY) % len(others)]
        rate = {k: b.throughput(k) for k in self.arms}
        best = max(self.arms, key=rate.get)
        if best != b.choice and rate[best] > rate[b.choice] * (1 + MARGIN):
            b.choice = best
        return b.choice

    def record(self, batch_size: int, k: int, tokens_per_seq: float, seconds: float) -> None:
        """One finished step with ``k`` drafts: mean tokens each sequence gained, and its wall time."""
        if self.enabled and seconds > 0 and k in self.arms:
            self._bucket(batch_size).samples[k].append((tokens_per_seq, seconds))

    def summary(self) -> dict:
        """Per bucket: the draft count now chosen and each arm's tokens per sequence per second."""
        return {
            bucket: {"k": b.choice, "tokens_per_s": {k: round(b.throughput(k), 2) for k in self.arms}}
            for bucket, b in sorted(self.buckets.items())
        }
