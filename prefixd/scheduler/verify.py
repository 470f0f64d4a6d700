"""The engine's side of drafting: which tokens a decoding lane verifies this round, and the
bookkeeping after its verify rows came back (rows kept, pages trimmed, drafts counted).

The device samples verify rows up to the first rejected draft and rolls the lane's state back
in the same round (`LaneWork.drafts`); what is left here is host bookkeeping only.
"""

from __future__ import annotations

from typing import Callable, Sequence

from prefixd.scheduler.draftpolicy import RoundCosts, allocate
from prefixd.scheduler.observer import EngineObserver
from prefixd.scheduler.lanes import Lane, PageTables
from prefixd.scheduler.records import LaneResult, LaneWork
from prefixd.scheduler.streams import Stream


class Verifies:
    """Drafts proposed per round and what the verifies accepted, for every lane."""

    def __init__(self, *, tables: PageTables, free_pages: Callable[[int], bool], observer: EngineObserver,
                 max_context: int, invariant_rows: bool, costs: RoundCosts | None = None) -> None:
        self.tables = tables
        self.free_pages = free_pages
        self.observer = observer
        self.max_context = max_context
        self.invariant_rows = invariant_rows
        self.costs = costs if costs is not None else RoundCosts()
        self._granted: dict[int, tuple[int, ...]] = {}  # lane index -> drafts granted this round
        self.drafted = 0  # drafted tokens verified since start
        self.accepted = 0  # of them, accepted

    def offer_round(self, decoding: Sequence[Lane]) -> None:
        """Share this round's draft rows between the `decoding` lanes (`allocate`): each
        drafting lane offers what it could draft, past neither its token nor its context
        limit, and the round grants the rows worth their cost at its row count."""
        offers = []
        for lane in decoding:
            stream = lane.stream
            if stream is None or stream.drafter is None:
                continue
            done = stream.num_prompt + len(stream.generated)
            limit = min(stream.req.max_tokens - len(stream.generated), self.max_context - done) - 1
            offer = stream.drafter.offer(stream.generated, limit)
            if offer is not None:
                offers.append((lane, offer))
        lengths = allocate([o.chances for _, o in offers], self.costs, base_rows=len(decoding))
        self._granted = {lane.index: lane.stream.drafter.take(k) for (lane, _), k in zip(offers, lengths)}

    def drafts_for(self, lane: Lane) -> tuple[int, ...]:
        """Tokens the lane verifies this round: what `offer_round` granted it, or none when
        pages for the verify rows are short."""
        drafts = self._granted.pop(lane.index, ())
        rows = lane.num_rows + 1 + len(drafts)
        need = self.tables.pages_needed(lane, rows)
        if drafts and need and not (self.free_pages(need) and self.tables.grow(lane, rows)):
            return ()
        return drafts

    def settle(self, lane: Lane, stream: Stream, work: LaneWork, res: LaneResult | None) -> int:
        """After decode or verify rows: count the draft, keep the rows whose tokens the stream
        emits, trim pages that held only rejected rows. Returns how many sampled tokens to emit."""
        if res is None or not 1 <= len(res.sampled) <= len(work.tokens):
            raise RuntimeError(f"lane {lane.index}: the device sampled {res} for {len(work.tokens)} rows")
        if work.drafts:
            accepted = len(res.sampled) - 1
            stream.draft_tokens += len(work.drafts)
            stream.accepted_tokens += accepted
            stream.drafter.record(len(work.drafts), accepted)
            self.observer.on_draft(len(work.drafts), accepted)
            self.drafted += len(work.drafts)
            self.accepted += accepted
        num = num_emitted(stream, res.sampled, self.max_context)
        lane.ids.extend(work.tokens[:num])  # row i gave token i; later rows were rejected or unneeded
        if self.invariant_rows:
            lane.prefilled_upto = work.start + num
        self.tables.trim(lane)
        return num


def num_emitted(stream: Stream, sampled: tuple[int, ...], max_context: int) -> int:
    """How many of `sampled` the stream emits: up to and including one that ends it."""
    done = stream.num_prompt + len(stream.generated)
    for i, token in enumerate(sampled):
        if (token in stream.req.stop_ids or len(stream.generated) + i + 1 >= stream.req.max_tokens
                or done + i + 1 >= max_context):
            return i + 1
    return len(sampled)
