"""Errors of multi-process runs: each names the rank or peer that failed and why."""
from __future__ import annotations

from mindspec.engine.errors import EngineError


class DistributedError(EngineError):
    """A multi-process run cannot go on; ``http_status`` is what a server answers with."""

    http_status = 503


class RankFailure(DistributedError):
    """A rank exited, hung past the timeout, or broke a collective."""


class RankDivergence(DistributedError):
    """Ranks disagreed about one step (a bug, or a non-deterministic decision taken per rank)."""


class HandoffError(DistributedError):
    """A PD hand-off could not be read, or does not fit this model."""

    http_status = 400
