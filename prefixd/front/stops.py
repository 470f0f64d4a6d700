"""Stop strings matched in streamed text, holding back only what could still become a stop.

The work per piece does not grow with the number of stop strings in Python: a piece without
a stop costs one search of a regex alternation compiled once (by StopSet, in the request builder's worker
thread, off the event loop), and the held-back tail is found by bisecting the sorted stops,
at most (longest stop - 1) times. The protocol bounds how many stops a request may send and
how long each may be (ipc/messages.py), so both are small. A piece that holds a stop is scanned
once more, up to the end of the leftmost match, for the stop that completes first.
"""

from __future__ import annotations

import bisect
import re


class StopSet:
    """A request's stop strings, prepared once: the compiled search and the sorted list."""

    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self._sorted = sorted(self.stops)
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._by_length: dict[int, set[str]] = {}
        for stop in self.stops:
            self._by_length.setdefault(len(stop), set()).add(stop)
        self._lengths = sorted(self._by_length, reverse=True)  # longest first: ties go to the earliest start
        self._search = re.compile("|".join(re.escape(s) for s in self.stops)).search if self.stops else None

    def __bool__(self) -> bool:
        return bool(self.stops)

    def first_match(self, text: str) -> int:
        """Where the stop that completes first in `text` begins (the longest, where several end
        at the same place), or -1.

        "First to complete" rather than "first to begin" is what a stream can decide the moment
        a stop arrives, so the answer never depends on how the text was cut into pieces.
        """
        if self._search is None:
            return -1
        found = self._search(text)
        if found is None:
            return -1
        for end in range(1, found.end() + 1):  # a shorter stop may end inside the leftmost one
            for length in self._lengths:
                if length <= end and text[end - length:end] in self._by_length[length]:
                    return end - length
        raise AssertionError(f"the search found {found.group()!r} but no stop ends by {found.end()}")

    def held_len(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper beginning of some stop."""
        for start in range(max(0, len(text) - self.max_len + 1), len(text)):
            tail = text[start:]
            i = bisect.bisect_left(self._sorted, tail)
            if i < len(self._sorted) and self._sorted[i].startswith(tail):
                return len(tail)
        return 0


class StopMatcher:
    """Feed decoded text in pieces; get back the text safe to send and whether a stop matched.

    Text that could be the beginning of a stop string is held back until the next piece
    decides it; on a match, the returned text ends right before the stop string and
    nothing after it is ever returned.
    """

    def __init__(self, stops: StopSet | list[str] | tuple[str, ...]) -> None:
        self._stops = stops if isinstance(stops, StopSet) else StopSet(stops)
        self._held = ""
        self.stopped = False

    @property
    def watching(self) -> bool:
        """Whether there is a stop string to match."""
        return bool(self._stops)

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text to send now, True when a stop string matched)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        first = self._stops.first_match(buf)
        if first >= 0:
            self._held = ""
            self.stopped = True
            return buf[:first], True
        keep = self._stops.held_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, once the stream ended without a stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
