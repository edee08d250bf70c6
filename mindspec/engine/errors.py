"""Engine errors: a request that can never run is rejected with a message naming the limit."""


class EngineError(Exception):
    """Engine bookkeeping cannot proceed (a bug or a misuse, never a user's bad input)."""


class RequestRejected(EngineError):
    """The request can never run under this configuration (prompt too long, empty, ...)."""
