"""Adaptive speculation: per decode step, speculate (K drafts) or not, from measured throughput.

Speculation pays when a step that verifies K+1 tokens per sequence costs less than the tokens it
yields. At batch 1 that holds easily (a step is dispatch- or bandwidth-bound, so K+1 tokens cost
little more than one); at large batches the step becomes compute-bound, every extra token costs
nearly as much as a real one, and rejected drafts are pure loss (users of vLLM and SGLang report
speculation turning into a slowdown there). So the choice is measured, not assumed: for each
batch-size bucket the controller keeps the recent steps of both kinds, (tokens yielded per
sequence, seconds), and picks the kind with the higher tokens per second. Each kind is tried a few
times first, and the kind not chosen is re-tried now and then (a few steps in a row), so the
estimate follows the acceptance rate and the context length as they change. Speculative steps that
catch up MTP cache entries skipped by plain steps are not measured: they cost more than a steady
speculative step, and counting them would make speculation look worse the longer it is off.

Either choice is lossless: a step without drafts is plain decoding, and the MTP caches it skipped
are caught up by the next speculative step (decode_inputs: ``last_accepted`` counts the entries
still to write).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_SAMPLES = 3  # steps of each kind measured in a bucket before choosing by throughput
WINDOW = 16  # recent steps per kind that the estimate uses
REEXPLORE_EVERY = 64  # steps in a bucket between two tries of the kind not chosen
REEXPLORE_BURST = 3  # steps per try: the first speculative one after plain steps catches up, unmeasured
MARGIN = 0.03  # switch only when the other kind is this much faster (no flip-flopping on noise)


def batch_bucket(batch_size: int) -> int:
    """Smallest power of two >= batch_size."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class _Bucket:
    samples: dict[bool, deque] = field(default_factory=lambda: {True: deque(maxlen=WINDOW), False: deque(maxlen=WINDOW)})
    choice: bool = True  # speculate
    steps: int = 0

    def throughput(self, speculate: bool) -> float:
        s = self.samples[speculate]
        seconds = sum(t for _, t in s)
        return sum(n for n, _ in s) / seconds if seconds > 0 else 0.0


class AdaptiveSpeculation:
    """Decides, per step, whether a batch of ``batch_size`` sequences speculates."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.buckets: dict[int, _Bucket] = {}

    def speculate(self, batch_size: int) -> bool:
        if not self.enabled:
            return True
        b = self.buckets.setdefault(batch_bucket(batch_size), _Bucket())
        b.steps += 1
        counts = {kind: len(b.samples[kind]) for kind in (True, False)}
        if min(counts.values()) < MIN_SAMPLES:
            return counts[True] <= counts[False]  # explore, speculation first
        if b.steps % REEXPLORE_EVERY < REEXPLORE_BURST:
            return not b.choice
        on, off = b.throughput(True), b.throughput(False)
        if b.choice and off > on * (1 + MARGIN):
            b.choice = False
        elif not b.choice and on > off * (1 + MARGIN):
            b.choice = True
        return b.choice

    def record(self, batch_size: int, speculated: bool, tokens_per_seq: float, seconds: float) -> None:
        """One finished step: mean tokens each sequence gained, and the step's wall time."""
        if self.enabled and seconds > 0:
            self.buckets.setdefault(batch_bucket(batch_size), _Bucket()).samples[speculated].append((tokens_per_seq, seconds))

    def summary(self) -> dict:
        """Per bucket: the current choice and both throughputs (tokens per sequence per second)."""
        return {
            bucket: {"speculate": b.choice, "on": round(b.throughput(True), 2), "off": round(b.throughput(False), 2)}
            for bucket, b in sorted(self.buckets.items())
        }
