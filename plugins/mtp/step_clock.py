"""What a decode step costs as the engine runs it, for adaptive speculation and tree_choice.

A step's cost is the time from its start (the plugin's inputs hook) to the next step's start:
its forward with the draft stages, verification, the plugin's bookkeeping, the engine's outputs
(every accepted token is appended, stop-checked and detokenised) and the scheduling of the next
step all count, as they do in the tokens per second a user sees. A window around the forward
alone leaves out the work a speculative step adds after it, and a plain step of an MTP engine
carries hidden-state bookkeeping that MTP off does not; both move the choice between draft
counts. The time is known only when the next step begins, so a finished step leaves a report
that the next start delivers. An interval that ends at a prefill or a mixed (SplitFuse) step may
hold an idle wait or a new request's admission, and one that starts there is no decode step: their
reports get None (not a sample).

With async scheduling (adaptive speculation is off there; tree_choice still times steps) the next
step starts on the host thread while this one runs, so a report may arrive a step late and carry
the interval between two later starts: the pipeline's period, what throughput sees. The clock is
locked: the two threads start and end steps.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

Report = Callable[[Optional[float]], None]


class StepClock:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._began: Optional[float] = None  # when the last step began
        self._began_decode = False  # whether it was a decode step
        self._report: Optional[Report] = None  # the last finished step's, waiting for its time
        self._lock = threading.Lock()

    def started(self, decode: bool) -> None:
        """A step begins (``decode``: a decode step): the step before it gets its time."""
        with self._lock:
            now = self._clock()
            report, self._report = self._report, None
            seconds = now - self._began if decode and self._began_decode else None
            self._began, self._began_decode = now, decode
        if report is not None:
            report(seconds)

    def ended(self, report: Report) -> None:
        """The step that began last is done; ``report`` gets its seconds when the next begins."""
        with self._lock:
            self._report = report
