"""When a shape without a package is compiled on the calling thread (an engine without compile
workers: ``LLM(decode_graphs=True)``, ``mindspec generate --compile``): once its eager runs have
cost what a compile is expected to take, a rent-or-buy rule.

A package costs minutes of compiling (the shipped model: ~2-4 on two cores) and saves part of
each run of its shape: ~15 ms of a ~45 ms prefill, ~10 ms of a speculative step. A prefill bucket
runs once per request, and the steps that catch MTP entries up after plain steps (adaptive
speculation; 8-64 draft rows per sequence, graph_runner.catches_up) come a few dozen in a run:
compiled when first met, an offline run over varied prompts would spend most of its time
compiling for shapes that barely recur. So such a shape runs eagerly, its eager seconds added up,
and is compiled once they reach what a compile is expected to take (this process's mean compile
time, else DEFAULT_COMPILE_S): the compile of a shape costs at most the eager time already spent
on it, so a run never takes much more than twice what the better choice in hindsight (compile at
once, or never) would have, and a shape met a few times costs no compile. A package already in
the cache loads at once.

Which shapes follow the rule (exported_step.py, ``ExportedSteps._due``): prefill buckets, unless
``MINDSPEC_COMPILE_PREFILL=1`` (benchmarks of the steady state, tests), and catch-up steps; every
other decode shape (a batch size, a draft count, sampled targets) recurs on every step of its
kind and compiles when first met. With compile workers (a server) the engine's ``export_after``
applies instead.
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


class EagerRuns:
    """The eager seconds each shape has cost while it had no package."""

    def __init__(self):
        self.seconds: dict[tuple, float] = {}  # shape key -> eager seconds so far
        self.renting: Optional[tuple] = None  # the shape the caller is running eagerly now

    def due(self, key: tuple, compile_s: float) -> bool:
        """Whether ``key``'s eager runs have cost ``compile_s``, the expected compile time; if not,
        the caller runs it eagerly and reports the time to ``ran_eagerly``."""
        if self.seconds.get(key, 0.0) >= compile_s:
            self.renting = None
            return True
        self.renting = key
        return False

    def ran_eagerly(self, seconds: float) -> None:
        """The eager run of the shape ``due`` turned down last took ``seconds``."""
        if self.renting is not None:
            self.seconds[self.renting] = self.seconds.get(self.renting, 0.0) + seconds
            self.renting = None
