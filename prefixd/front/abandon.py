"""Abandoned generates: a client that keeps leaving the work it asked for waits its turn.

A generate is *abandoned* when its client cancels it (a `cancel` frame) or leaves it behind
(its connection closes) after it reached the engine. Its prefill and decode rounds ran
beside everyone else's streams, and nobody reads what they made. Now and then that is
normal: a user stops a reply, an editor drops a stale completion. A client that does it
again and again (send, read a token, hang up, repeat) keeps prefill rounds running in every
other client's rounds, and the frame pacing cannot see it: a generate is one frame.

So each client (peer process, all its connections: the pacing's notion) has a *level*:
every abandoned generate adds 1, and it drains at `drain_per_s`. While the level is above
`grace`, each abandon sets a *hold* of

    min(hold_max_s, HOLD_BASE_S * 2 ** (level - grace - 1))

from that moment: the client's next generates wait before they ask for a seat (fair.py)
until the hold has passed, and while its level stays above the grace, they then go one at
a time (a generate waits while another of the client's holds a seat), so what a hold lets
through is one prefill, not a burst. They wait only while another client holds a seat or
waits for one; a client alone on the daemon never waits. A held generate can be cancelled
like any generate waiting for its seat. With the defaults, a client that abandons one
generate every ten seconds, or a burst of six, never waits.

    level:  ... 6 (grace) | 7     8     9     10    11    12 ...
    hold:         none    | 0.5s  1s    2s    4s    8s    16s ... up to hold_max_s
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import anyio

HOLD_BASE_S = 0.5  # the first hold past the grace
POLL_S = 0.05  # how often a held generate checks whether it is still contended


@dataclass(frozen=True, slots=True)
class AbandonLimits:
    """`hold_max_s` 0: no client is ever held."""

    grace: int = 6  # abandoned generates a client may have on its level before it is held
    drain_per_s: float = 0.1  # how fast a level drains (abandons forgiven a second)
    hold_max_s: float = 30.0  # the longest hold

    def __post_init__(self) -> None:
        if self.grace < 0 or self.drain_per_s <= 0 or self.hold_max_s < 0:
            raise ValueError(f"abandon limits: grace >= 0, drain > 0 and hold_max >= 0: {self}")

    def hold_s(self, level: float) -> float:
        if level <= self.grace or self.hold_max_s == 0:
            return 0.0
        return min(self.hold_max_s, HOLD_BASE_S * 2.0 ** (level - self.grace - 1))


@dataclass(slots=True)
class _Record:
    level: float
    at: float  # when `level` was last drained
    hold_until: float


class AbandonLedger:
    """Every client's level and hold, by peer (event loop only)."""

    def __init__(self, limits: AbandonLimits, clock: Callable[[], float] = anyio.current_time) -> None:
        self.limits = limits
        self._clock = clock
        self._clients: dict[Hashable, _Record] = {}
        self.abandoned = 0  # over the daemon's life
        self.holds = 0  # generates that waited
        self.held_s = 0.0  # and how long, together

    def abandon(self, peer: Hashable, count: int = 1) -> None:
        """`count` of `peer`'s generates were abandoned now."""
        if count <= 0:
            return
        now = self._clock()
        self._forget_drained(now)
        record = self._clients.get(peer)
        if record is None:
            record = self._clients[peer] = _Record(0.0, now, now)
        record.level = self._drained(record, now) + count
        record.at = now
        hold = self.limits.hold_s(record.level)
        if hold > 0:
            record.hold_until = max(record.hold_until, now + hold)
        self.abandoned += count

    def level(self, peer: Hashable) -> float:
        record = self._clients.get(peer)
        return 0.0 if record is None else self._drained(record, self._clock())

    def hold_left_s(self, peer: Hashable) -> float:
        record = self._clients.get(peer)
        return 0.0 if record is None else max(0.0, record.hold_until - self._clock())

    def held(self, peer: Hashable, seated: int) -> float:
        """How long `peer`'s next generate should wait (seconds, or POLL_S to look again),
        with `seated` of its generates holding seats; 0: it may go."""
        left = self.hold_left_s(peer)
        if left > 0:
            return left
        return POLL_S if seated > 0 and self.level(peer) > self.limits.grace and self.limits.hold_max_s else 0.0

    async def wait(self, peer: Hashable, contended: Callable[[], bool], seated: Callable[[], int] = lambda: 0) -> None:
        """Return once `peer`'s hold has passed (and, past its grace, none of its generates
        holds a seat: `seated()`), or at once while `contended()` is False."""
        first = True
        while (left := self.held(peer, seated())) > 0 and contended():
            if first:
                self.holds += 1
                first = False
            pause = min(left, POLL_S)
            self.held_s += pause
            await anyio.sleep(pause)

    def stats(self) -> dict[str, float]:
        """For status: totals, and how many clients are held now."""
        now = self._clock()
        return {"abandoned": self.abandoned, "abandon_holds": self.holds,
                "abandon_held_s": round(self.held_s, 3),
                "clients_held": sum(1 for r in self._clients.values() if r.hold_until > now)}

    def _drained(self, record: _Record, now: float) -> float:
        return max(0.0, record.level - (now - record.at) * self.limits.drain_per_s)

    def _forget_drained(self, now: float) -> None:
        for peer in [p for p, r in self._clients.items() if r.hold_until <= now and not self._drained(r, now)]:
            del self._clients[peer]
