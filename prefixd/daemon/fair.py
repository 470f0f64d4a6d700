"""Fair seating: the order in which socket connections' generates reach the engine.

The engine admits the streams it is given first come, first served. A connection that
sends many generates (or sends them faster) would then hold most lanes and leave the
others' requests queued behind its own. So a generate takes a *seat* before it is
submitted and gives it back when its stream ends; there are as many seats as lanes. While
every seat is taken, a freed seat goes to the waiting connection that holds the fewest
seats (max-min fairness), and among equals to the one that has waited longest.

    connection A (holds 3) ──┐
    connection B (holds 0) ──┼──▶ next free seat: B, then A's oldest waiter
    connection A (holds 3) ──┘

Seats order submissions only: the engine still decides lanes, pages and rounds. Work that
does not take a seat (the HTTP front) is admitted by the engine beside it, in its order.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable

import anyio


@dataclass(order=True)
class _Waiter:
    held: int  # seats its owner held when it queued (the order key, refreshed on every grant)
    seq: int
    owner: Hashable = field(compare=False)
    granted: anyio.Event = field(compare=False, default_factory=anyio.Event)


class FairSeats:
    """`num_seats` seats handed out max-min fairly across owners (event loop only)."""

    def __init__(self, num_seats: int) -> None:
        if num_seats < 1:
            raise ValueError(f"num_seats {num_seats}: needs at least 1")
        self.num_seats = num_seats
        self._held: Counter[Hashable] = Counter()
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def num_free(self) -> int:
        return self.num_seats - sum(self._held.values())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def held_by(self, owner: Hashable) -> int:
        return self._held[owner]

    async def take(self, owner: Hashable) -> None:
        """Wait for a seat for `owner`. Cancelled while waiting, it takes none."""
        if self.num_free > 0 and not self._waiting:
            self._held[owner] += 1
            return
        waiter = _Waiter(self._held[owner], next(self._seq), owner)
        self._waiting.append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():
                self.give_back(owner)  # granted as the wait was cancelled: pass the seat on
            else:
                self._waiting.remove(waiter)
            raise

    def give_back(self, owner: Hashable) -> None:
        """Return one of `owner`'s seats; the next waiter in fair order takes it."""
        if self._held[owner] <= 0:
            raise RuntimeError(f"give_back without a seat held by {owner!r}")
        self._held[owner] -= 1
        if not self._held[owner]:
            del self._held[owner]
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.num_free > 0:
            for waiter in self._waiting:
                waiter.held = self._held[waiter.owner]
            chosen = min(self._waiting)
            self._waiting.remove(chosen)
            self._held[chosen.owner] += 1
            chosen.granted.set()
