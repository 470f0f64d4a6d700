"""Who goes first: the rows each client was served lately, and whether rounds must stay short.

`ClientShares` keeps, per client (`StreamRequest.client`), the rows its streams ran in recent
rounds: a sum that every round multiplies by `DECAY` and adds the round's rows to. Waiting
streams are seated, and a round's prefill rows handed out, in the order of `order_key`: the
client with the smallest share first, and within one client by arrival (FIFO). A client
sending one short request at a time stays near zero however much another client sends, so it
is seated and prefilled before the others' queued and long work.

`RoundPolicy` adds the memory that keeps rounds short: a round that carries decode rows or a
short prefill is *busy* (long prefills get only `busy_prefill_rows` of it), and so are the
`BUSY_LINGER_ROUNDS` rounds after one, so a client whose short request just ended finds a
short round in flight when it sends the next. A round that gives a first token may hold long
prefills back altogether, but never two rounds in a row, so they advance at least every other
round however many short requests come. Counted in rounds, not seconds: the engine's clock
plays no part in what a round holds.

One thing is left to the caller's clock: after a busy spell, when only long prefills are left,
`pause_before_long()` says (once) that the caller may give the clients a moment to send their
next short request before the first round of long prefills alone (engine/process.py). That
round would otherwise be in flight when the next short request comes, and it would wait for
it; the pause changes when rounds start, never what a round holds or any row's bits.
"""

from __future__ import annotations

from typing import Iterable

from prefixd.scheduler.rounds import RoundShape
from prefixd.scheduler.streams import Stream

DECAY = 0.9  # per round: a row served 20 rounds ago counts about a tenth of one served now
BUSY_LINGER_ROUNDS = 2
_FORGET_BELOW = 1e-3  # a client whose share decayed below this is dropped from the table


class ClientShares:
    """Rows served per client lately (decayed per round)."""

    def __init__(self, decay: float = DECAY) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._served: dict[str, float] = {}

    def served(self, client: str) -> float:
        return self._served.get(client, 0.0)

    def order_key(self, stream: Stream) -> tuple[float, int]:
        """Least served client first; FIFO within a client (and between equal shares)."""
        return self.served(stream.req.client), stream.seq

    def end_round(self, rows_by_client: dict[str, int]) -> None:
        """Decay every share, then add the rows each client's streams ran in the round."""
        served = {c: v * self.decay for c, v in self._served.items()}
        for client, rows in rows_by_client.items():
            served[client] = served.get(client, 0.0) + rows
        self._served = {c: v for c, v in served.items() if v >= _FORGET_BELOW}


class RoundPolicy:
    """The scheduler's memory between rounds: client shares and whether rounds stay short."""

    def __init__(self, *, linger_rounds: int = BUSY_LINGER_ROUNDS) -> None:
        self.shares = ClientShares()
        self.linger_rounds = linger_rounds
        self._linger = 0  # busy rounds still owed after the last round with short work
        self._held = False  # the last round held long prefills back
        self._pause_owed = False  # a busy round ran and no pause was taken since

    @property
    def lingering(self) -> bool:
        """Whether the next round is busy because a recent one was."""
        return self._linger > 0

    @property
    def may_hold(self) -> bool:
        """Whether the next round may hold long prefills back (the last one did not)."""
        return not self._held

    def planned(self, rows: Iterable[tuple[Stream, int]], shape: RoundShape) -> None:
        """A round was planned: `rows` (stream, rows it runs) and its shape."""
        by_client: dict[str, int] = {}
        for stream, num in rows:
            by_client[stream.req.client] = by_client.get(stream.req.client, 0) + num
        self.shares.end_round(by_client)
        self._held = shape.held
        if shape.busy and by_client:
            self._linger = self.linger_rounds
            self._pause_owed = True
        elif self._linger > 0:
            self._linger -= 1
        else:
            self._pause_owed = False

    @property
    def pause_owed(self) -> bool:
        """Whether a busy spell ran with no pause taken since (`pause_before_long`)."""
        return self._pause_owed

    def take_pause(self) -> None:
        """The pause owed is taken (once per busy spell)."""
        self._pause_owed = False
