"""Pacing: how much of the event loop one client may take, enforced by reading it slower.

A *client* is the peer process at the other end of a socket connection (SO_PEERCRED: pid
and uid); all of its connections draw on one budget, so a client that opens a new
connection for every burst gains nothing by it. The budget is a bucket of frame credits
that fills at `rate` a second up to `burst`:

- every frame a connection reads costs 1, and a frame refused with an `error` reply costs
  `error_cost` (errors are what a hostile client sends most, and what no honest client
  needs to send fast);
- every new connection costs `connect_cost` (so a reconnect flood costs its sender);
- a connection whose client is in debt (fewer than 0 credits) reads nothing more until the
  bucket has filled back to one *quantum* (`QUANTUM_S` of its rate, at least one credit, at
  most its burst). Its frames wait in the kernel's socket buffer, and once that is full the
  client's own writes block: backpressure. Nothing is dropped, and every frame a client
  sends is answered in order, only later. (A client paced frame by frame would cost the loop
  a timer, a wake-up and a reply write per frame, several times the frame's own work; paced
  a quantum at a time, its frames are read and answered in batches.)

A client that stays under the rate never waits. A client's budget outlives its
connections until it has filled back up (a reconnect does not reset it), then is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import anyio

QUANTUM_S = 0.05  # a client in debt is read again once this much of its rate has refilled


@dataclass(frozen=True, slots=True)
class PaceLimits:
    """One client's budget; `rate` None: no pacing at all."""

    rate: float | None = 500.0  # frame credits a second
    burst: int = 4096  # credits a client may spend at once (and starts with)
    error_cost: int = 16  # credits a frame refused with an error costs
    connect_cost: int = 64  # credits a new connection costs

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"the client frame rate must be positive: {self.rate}")
        if self.burst < 1 or self.error_cost < 1 or self.connect_cost < 0:
            raise ValueError(f"pace limits out of range: {self}")


@dataclass
class PaceCounts:
    """What pacing did, over one client or over the daemon's life."""

    frames: int = 0  # frames read
    errors: int = 0  # of them, refused with an error
    waits: int = 0  # times a connection paused reading
    waited_s: float = 0.0  # seconds connections spent paused, all together


class ClientBudget:
    """The frame credits of one client (every connection of one peer process)."""

    def __init__(self, limits: PaceLimits, now: float, totals: PaceCounts | None = None) -> None:
        self.limits = limits
        self.credits = float(limits.burst)
        self._stamp = now
        self.connections = 0
        self.counts = PaceCounts()
        self._totals = totals or PaceCounts()

    def _fill(self, now: float) -> None:
        rate = self.limits.rate
        if rate is not None and now > self._stamp:
            self.credits = min(float(self.limits.burst), self.credits + (now - self._stamp) * rate)
        self._stamp = max(self._stamp, now)

    def charge(self, cost: float, now: float) -> None:
        self._fill(now)
        self.credits -= cost

    def frame(self, refused: bool = False) -> None:
        """Charge one frame read: 1 credit, `error_cost` when it was refused with an error."""
        self.charge(self.limits.error_cost if refused else 1, anyio.current_time())
        for counts in (self.counts, self._totals):
            counts.frames += 1
            counts.errors += refused

    def refused(self) -> None:
        """A frame already charged as read was refused after all: charge the difference."""
        self.charge(self.limits.error_cost - 1, anyio.current_time())
        self.counts.errors += 1
        self._totals.errors += 1

    def debt_s(self, now: float) -> float:
        """Seconds until the bucket is back at 0 credits (0.0 when it is not in debt)."""
        self._fill(now)
        if self.limits.rate is None or self.credits >= 0:
            return 0.0
        return -self.credits / self.limits.rate

    def quantum(self) -> float:
        """The credits a client in debt is let back in with (see the module docstring)."""
        rate = self.limits.rate
        return 0.0 if rate is None else min(float(self.limits.burst), max(1.0, rate * QUANTUM_S))

    def full(self, now: float) -> bool:
        self._fill(now)
        return self.limits.rate is None or self.credits >= self.limits.burst

    async def wait(self) -> None:
        """Return at once when the client is not in debt; in debt, once its bucket holds a
        quantum again (its other connections may have spent it first: then wait again)."""
        while self.debt_s(anyio.current_time()) > 0:
            assert self.limits.rate is not None  # only a paced client is ever in debt
            pause = (self.quantum() - self.credits) / self.limits.rate
            for counts in (self.counts, self._totals):
                counts.waits += 1
                counts.waited_s += pause
            await anyio.sleep(pause)


class Pacer:
    """Every client's budget, by peer; connections take theirs with `join` and `leave`."""

    def __init__(self, limits: PaceLimits, clock: Callable[[], float] = anyio.current_time) -> None:
        self.limits = limits
        self._clock = clock
        self.clients: dict[Hashable, ClientBudget] = {}
        self.totals = PaceCounts()  # over the daemon's life, forgotten clients included

    def join(self, peer: Hashable) -> ClientBudget:
        """The budget of `peer` (pid, uid), charged `connect_cost` for the new connection."""
        budget = self.visit(peer)
        budget.charge(self.limits.connect_cost, self._clock())
        return budget

    def visit(self, peer: Hashable) -> ClientBudget:
        """The budget of `peer` for one request of a connectionless front (HTTP): held like a
        connection until `leave`, without the connect cost (an HTTP client reconnects freely)."""
        now = self._clock()
        self._forget_idle(now)
        budget = self.clients.get(peer)
        if budget is None:
            budget = self.clients[peer] = ClientBudget(self.limits, now, self.totals)
        budget.connections += 1
        return budget

    def leave(self, budget: ClientBudget) -> None:
        budget.connections -= 1

    def _forget_idle(self, now: float) -> None:
        """Drop the budgets of clients with no connection whose bucket is full again: a
        new connection from them would start from a full bucket anyway."""
        for peer in [p for p, b in self.clients.items() if not b.connections and b.full(now)]:
            del self.clients[peer]

    def stats(self) -> dict[str, float]:
        """For status: the daemon's totals, and how many clients are paused now."""
        now = self._clock()
        return {"paced_waits": self.totals.waits, "paced_s": round(self.totals.waited_s, 3),
                "clients_in_debt": sum(1 for b in self.clients.values() if b.debt_s(now) > 0)}
