"""Stop strings matched in streamed text, holding back only what could still become a stop."""

from __future__ import annotations


class StopMatcher:
    """Feed decoded text in pieces; get back the text safe to send and whether a stop matched.

    Text that could be the beginning of a stop string is held back until the next piece
    decides it; on a match, the returned text ends right before the stop string and
    nothing after it is ever returned.
    """

    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text to send now, True when a stop string matched)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        first = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if first >= 0:
            self._held = ""
            self.stopped = True
            return buf[:first], True
        keep = self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, once the stream ended without a stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
