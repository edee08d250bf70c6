"""Adaptive speculation for draft trees: per batch-size bucket, a tree step or a plain step,
whichever has yielded more tokens per second.

A tree step verifies every sequence's whole tree, so the choice is per step, not per sequence
(adaptive.py chooses chain lengths per sequence). Each bucket times both kinds (MIN_SAMPLES steps
each, trees first), then runs the faster by tokens per second over their recent steps, and tries
the other for REEXPLORE_BURST steps every REEXPLORE_EVERY steps (step cost follows the context
length). A tree step right after plain steps also writes the MTP entries they skipped, so it is
counted for tokens but not timed, as adaptive.py does for chains. Plain steps are lossless like
tree steps; the MTP caches they skip are caught up by the next tree step's window.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .adaptive import MARGIN, MIN_SAMPLES, REEXPLORE_BURST, REEXPLORE_EVERY, WINDOW, batch_bucket


@dataclass
class _Arm:
    tokens: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    seconds: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def rate(self) -> float:
        return sum(self.tokens) / sum(self.seconds) if self.seconds and sum(self.seconds) > 0 else 0.0


@dataclass
class _Bucket:
    arms: dict = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
    choice: bool = True
    steps: int = 0
    burst: int = 0  # steps left of a try of the arm not chosen


class TreeOrPlain:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.buckets: dict[int, _Bucket] = {}

    def tree_step(self, batch_size: int) -> bool:
        """Whether the next step at this batch size verifies trees."""
        if not self.enabled:
            return True
        b = self.buckets.setdefault(batch_bucket(batch_size), _Bucket())
        for arm in (True, False):
            if len(b.arms[arm].seconds) < MIN_SAMPLES:
                return arm
        if b.burst:
            return not b.choice
        return b.choice

    def record(self, batch_size: int, tree: bool, tokens: int, seconds: Optional[float]) -> None:
        """One step of either kind: the tokens it emitted and its time (None: not a sample)."""
        if not self.enabled:
            return
        b = self.buckets.setdefault(batch_bucket(batch_size), _Bucket())
        if seconds is not None:
            b.arms[tree].tokens.append(tokens)
            b.arms[tree].seconds.append(seconds)
        if b.burst and tree != b.choice:
            b.burst -= 1
        b.steps += 1
        rates = {arm: b.arms[arm].rate() for arm in (True, False)}
        if rates[not b.choice] > (1 + MARGIN) * rates[b.choice]:
            b.choice = not b.choice
        if b.steps % REEXPLORE_EVERY == 0 and all(len(a.seconds) >= MIN_SAMPLES for a in b.arms.values()):
            b.burst = REEXPLORE_BURST
