"""LaunchSignal: a one-shot callback run when the next step's work is handed to the device.

Async scheduling (mindspec/engine/async_scheduling.py) runs its host thread beside the device
step, and both threads' Python holds the GIL: started earlier, the host thread would slow the
calling thread's own input building and delay the launch. So it starts once the step's work has
left the interpreter: right after a captured graph's replay is queued, right before a compiled
package's call (which releases the GIL), or as an eager forward begins (its ops release the GIL
one by one).
"""
from __future__ import annotations

from typing import Callable, Optional


class LaunchSignal:
    def __init__(self):
        self._callback: Optional[Callable[[], None]] = None

    def arm(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` at the next launch (replacing one armed before)."""
        self._callback = callback

    def fire(self) -> None:
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()
