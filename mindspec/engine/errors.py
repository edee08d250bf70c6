"""Engine errors: a request that can never run is rejected with a message naming the limit."""


class EngineError(Exception):
    """Engine bookkeeping cannot proceed (a bug or a misuse, never a user's bad input)."""


class RequestRejected(EngineError):
    """The request can never run under this configuration (prompt too long, empty, ...)."""


class CapacityExceeded(RequestRejected):
    """The request could run, but not now (no free batch slot or KV blocks where it cannot wait,
    e.g. a prefilled hand-off that must be adopted at once); retrying later may succeed."""
