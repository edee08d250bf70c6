"""Composed torch paths taken outside the fused ops' limits, logged once per (op, reason).

The composed path is the cpu backend's pure-torch code, which runs on any device; the counter lets
tests (and operators) see which ops ran fused and which did not.
"""
from __future__ import annotations

import logging
from collections import Counter

logger = logging.getLogger("mindspec.backends.npu")


class FallbackLog:
    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def note(self, op: str, reason: str) -> None:
        key = (op, reason)
        if key not in self.counts:
            logger.warning("npu backend: %s uses the composed torch path: %s", op, reason)
        self.counts[key] += 1

    def ops(self) -> set[str]:
        return {op for op, _ in self.counts}
