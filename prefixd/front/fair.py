"""Fair seating: the order in which socket connections' generates reach the engine.

The engine admits the streams it is given first come, first served. A client that sends
many generates (or sends them faster) would then hold most lanes and leave the others'
requests queued behind its own. So a generate takes a *seat* before it is submitted and
gives it back when its stream ends; there are as many seats as lanes. While every seat is
taken, a freed seat goes to the waiting *client* (peer process, all its connections) that
holds the fewest seats (max-min fairness); between connections of one client, to the
connection holding the fewest; among equals, to the one that has waited longest.

    client P, connection A (holds 3) ──┐
    client Q, connection B (holds 0) ──┼──▶ next free seat: B, then P's oldest waiter
    client P, connection C (holds 0) ──┘     (P holds 3 through A; C only once Q holds as many)

An owner is a path, outermost first: `(peer, connection)` from the socket front, or any
single hashable (one level). Seats order submissions only: the engine still decides lanes,
pages and rounds. Work that does not take a seat (the HTTP front) is admitted by the
engine beside it, in its order.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable

import anyio


def _path(owner: Hashable) -> tuple:
    return owner if isinstance(owner, tuple) else (owner,)


def _levels(owner: Hashable) -> list[tuple]:
    """The owner's path prefixes, outermost first: ((peer,), (peer, connection))."""
    path = _path(owner)
    return [path[: k + 1] for k in range(len(path))]


@dataclass(order=True)
class _Waiter:
    held: tuple[int, ...]  # seats held at each level of its owner's path (refreshed on every grant)
    seq: int
    owner: Hashable = field(compare=False)
    granted: anyio.Event = field(compare=False, default_factory=anyio.Event)


class FairSeats:
    """`num_seats` seats handed out max-min fairly across owners (event loop only)."""

    def __init__(self, num_seats: int) -> None:
        if num_seats < 1:
            raise ValueError(f"num_seats {num_seats}: needs at least 1")
        self.num_seats = num_seats
        self._held: Counter[tuple] = Counter()  # seats held, by every prefix of an owner's path
        self._taken = 0
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def num_free(self) -> int:
        return self.num_seats - self._taken

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def held_by(self, owner: Hashable) -> int:
        return self._held[_path(owner)]

    def others_active(self, owner: Hashable) -> bool:
        """Whether a client other than `owner`'s (the first level of its path) holds a seat
        or waits for one."""
        mine = _path(owner)[0]
        return (any(len(key) == 1 and key[0] != mine for key in self._held)
                or any(_path(w.owner)[0] != mine for w in self._waiting))

    def _order(self, owner: Hashable) -> tuple[int, ...]:
        return tuple(self._held[level] for level in _levels(owner))

    def _add(self, owner: Hashable, change: int) -> None:
        self._taken += change
        for level in _levels(owner):
            self._held[level] += change
            if not self._held[level]:
                del self._held[level]

    async def take(self, owner: Hashable) -> None:
        """Wait for a seat for `owner`. Cancelled while waiting, it takes none."""
        if self.num_free > 0 and not self._waiting:
            self._add(owner, 1)
            return
        waiter = _Waiter(self._order(owner), next(self._seq), owner)
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
        if self._held[_path(owner)] <= 0:
            raise RuntimeError(f"give_back without a seat held by {owner!r}")
        self._add(owner, -1)
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.num_free > 0:
            for waiter in self._waiting:
                waiter.held = self._order(waiter.owner)
            chosen = min(self._waiting)
            self._waiting.remove(chosen)
            self._add(chosen.owner, 1)
            chosen.granted.set()
