"""When a prefill bucket without a package is compiled on the calling thread (an engine without
compile workers: ``LLM(decode_graphs=True)``, ``mindspec generate --compile``).

A decode shape runs on every step, so its package pays at once. A prefill runs once per request,
and a package saves a fraction of an eager prefill (the shipped model: ~15 ms of ~45) for
minutes of compiling: an offline run whose prompts meet a dozen buckets a few times each would
spend most of its time compiling. So a bucket runs eagerly, its eager seconds added up, and is
compiled once they reach what a compile is expected to take (this process's mean compile time,
else DEFAULT_COMPILE_S): for each bucket the compile costs at most the eager time already spent
on it, so a run never takes much more than twice what the better choice in hindsight (compile at
once, or never) would have, and a bucket met a few times costs no compile. A package already in
the cache loads at once. ``MINDSPEC_COMPILE_PREFILL=1`` compiles each bucket when first met
(benchmarks of the steady state, tests); with compile workers the engine's ``export_after`` applies
instead (exported_step.py).
"""
from __future__ import annotations

import os
from typing import Optional

from mindspec.modeling.prefill_padding import PREFILL_ENV

# A package's export and compile before this process has timed one: the shipped model's take
# ~100-150 s on two cores.
DEFAULT_COMPILE_S = 120.0


def prefills_compile_at_once() -> bool:
    """``MINDSPEC_COMPILE_PREFILL=1``: every prefill bucket compiles when first met."""
    return os.environ.get(PREFILL_ENV) == "1"


class EagerPrefills:
    """The eager seconds each prefill shape has cost while it had no package."""

    def __init__(self):
        self.seconds: dict[tuple, float] = {}  # shape key -> eager seconds so far
        self._last: Optional[tuple] = None  # the shape the caller is running eagerly now

    def due(self, key: tuple, compile_s: float) -> bool:
        """Whether ``key``'s eager runs have cost ``compile_s``, the expected compile time; if not,
        the caller runs it eagerly and reports the time to ``ran_eagerly``."""
        if self.seconds.get(key, 0.0) >= compile_s:
            return True
        self._last = key
        return False

    def ran_eagerly(self, seconds: float) -> None:
        """The eager run of the shape ``due`` turned down last took ``seconds``."""
        if self._last is not None:
            self.seconds[self._last] = self.seconds.get(self._last, 0.0) + seconds
            self._last = None
