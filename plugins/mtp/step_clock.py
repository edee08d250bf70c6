"""What a decode step costs as the engine runs it, for adaptive speculation and tree_choice.

A step's cost is the time between the ends of two consecutive decode steps: the scheduler, the
inputs, the forward with its draft stages, verification, the plugin's bookkeeping and the
engine's outputs (detokenising, stop checks) all count, as they do in the tokens per second a
user sees. A window around the forward alone leaves out the work a speculative step adds after
it (every accepted token goes through the outputs), and a plain step of an MTP engine carries
hidden-state bookkeeping that MTP off does not; both move the choice between draft counts. With
async scheduling, the next step's host work overlaps this one's forward and the interval is the
pipeline's period, which is again what throughput sees. An interval that begins at a prefill or
a mixed (SplitFuse) step is no decode step's cost and is not reported.
"""
from __future__ import annotations

import time
from typing import Callable, Optional


class StepClock:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._last: Optional[float] = None  # when the previous step ended
        self._last_decoded = False  # whether it was a decode step

    def lap(self, decode: bool) -> Optional[float]:
        """A step ended (``decode``: a decode step) -> seconds since the previous one ended when
        both are decode steps, else None."""
        now = self._clock()
        seconds = now - self._last if decode and self._last_decoded and self._last is not None else None
        self._last, self._last_decoded = now, decode
        return seconds
