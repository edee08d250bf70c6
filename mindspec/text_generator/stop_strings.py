"""Stop-string matching over streamed text."""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    """Cut streamed text at the earliest stop string.

    ``feed(new_text)`` returns ``(text_to_emit, matched)``. Text is emitted up to, not including,
    the stop string found; a tail that could still be the start of a stop string (at most
    ``max(len(stop)) - 1`` chars) is held back until more text decides it. After a match every
    later ``feed`` returns ``("", True)``. ``flush()`` returns the held tail at the end of
    generation when nothing matched.
    """

    def __init__(self, stop: Iterable[str] | None = None) -> None:
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in (stop or ()) if s))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._matched: str | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stops

    @property
    def matched(self) -> bool:
        return self._matched is not None

    @property
    def matched_stop(self) -> str | None:
        """The stop string that matched, if any."""
        return self._matched

    @property
    def held(self) -> str:
        return self._held

    def feed(self, new_text: str) -> tuple[str, bool]:
        if self._matched is not None:
            return "", True
        if not self._stops:
            return new_text, False
        buf = self._held + new_text
        best, best_stop = -1, None
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, best_stop = i, s
        if best_stop is not None:
            self._matched = best_stop
            self._held = ""
            return buf[:best], True
        hold = 0
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                hold = k
                break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self._matched is not None else held
