"""The engine: streams in, lane rounds out.

One `step()` is one lane round: `launch()` (drop cancels, admit, plan) ->
`device.run_round()` -> `land()` (append tokens, keep cuts, finish streams).
The round's plan is the only device call: seatings, lane work and captures are decided on
the host and run by the device in one go. A lane the device reports failed (`LaneResult.error`)
ends its stream alone; the round's other lanes go on. Single-threaded: the daemon calls it
from one engine thread.

Overlap: a caller that runs the launched round elsewhere (the daemon's device thread) may call
`admit_ahead()` while it runs. That seats waiting streams for the next round, with their store
lookups and page bookkeeping, on lanes the round in flight leaves alone; it reads nothing the
round will answer and changes nothing the round reads (its plan is frozen, its lanes stay
busy until `land()`, and a page it writes is held by its lane). Every stream's tokens are
those of rounds run one at a time; only when a waiting stream is seated moves.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable

from prefixd.scheduler.admission import Admitter, Seating
from prefixd.scheduler.config import SchedulerConfig, store_budget_bytes
from prefixd.scheduler.cuts import CutKeeper
from prefixd.scheduler.diagnosis import RECENT_REPORTS, cache_report
from prefixd.scheduler.device import Device, LowerTier
from prefixd.scheduler.draftpolicy import RoundCosts
from prefixd.scheduler.drafting import new_drafter
from prefixd.scheduler.mtp import ask_proposals, offer_proposals
from prefixd.scheduler.observer import EngineObserver, NullObserver
from prefixd.scheduler.engine_state import check_engine, engine_status
from prefixd.scheduler.fairness import RoundPolicy
from prefixd.scheduler.lanes import Lane, PageTables
from prefixd.scheduler.pages import PageAllocator
from prefixd.scheduler.chunks import plan_schedule
from prefixd.scheduler.plan_builder import PlanBuilder
from prefixd.scheduler.records import FinishReason, LaneResult, LaneWork, RoundPlan, RoundResult, TokenLogprob
from prefixd.scheduler.rounds import PlannedWork, RoundBudget, is_short, plan_round
from prefixd.scheduler.store import PrefixStore, make_key
from prefixd.scheduler.streams import (DoneEvent, Stream, StreamRequest, TokenEvent, context_full_note,
                                       validate_request)
from prefixd.scheduler.verify import Verifies

Event = TokenEvent | DoneEvent
OUT_OF_PAGES_NOTE = "stopped early: no KV pages left for another row"


@dataclasses.dataclass(frozen=True, slots=True)
class Launched:
    """A round scheduled by `Engine.launch`: its frozen plan and what `land` needs of it."""

    plan: RoundPlan
    planned: list[PlannedWork]
    events: list[Event]  # done events of the streams dropped while scheduling it
    t0: float


class Engine:
    """Schedules streams onto lanes and runs lane rounds on `device`.

    `store_factory(allocator=, page_size=, kv_bytes_per_page=, budget_bytes=, invariant_rows=,
    clock=)` builds the prefix store when `config.cache` (default `PrefixStore`); returning None
    leaves only resident lanes. `disk` (a `LowerTier`: `prefixd.disk.tier.DiskTier`, used only
    with a store) is written through on every keep and asked when a lookup misses RAM; its loads and
    exports are items of the next round's plan.
    """

    def __init__(
        self,
        device: Device,
        config: SchedulerConfig,
        *,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        store_factory: Callable[..., PrefixStore | None] | None = None,
        disk: LowerTier | None = None,
    ) -> None:
        info = device.info
        config.check_device(info)
        self.device = device
        self.info = info
        self.config = config
        self.observer: EngineObserver = observer if observer is not None else NullObserver()
        self.clock = clock
        self.max_context = config.context_for(info)
        self.allocator = PageAllocator(info.num_pages)
        self.tables = PageTables(self.allocator, info.page_size)
        self.lanes = [Lane(i) for i in range(config.num_lanes)]
        self.store: PrefixStore | None = None
        if config.cache:
            self.store = (store_factory or PrefixStore)(
                allocator=self.allocator, page_size=info.page_size, kv_bytes_per_page=info.kv_bytes_per_page,
                budget_bytes=store_budget_bytes(info, config), invariant_rows=info.invariant_rows, clock=clock)
        self.disk: LowerTier | None = disk if self.store is not None else None
        if self.disk is not None:
            self.disk.attach(store=self.store, allocator=self.allocator)
        self._streams: dict[int, Stream] = {}
        self.reports: collections.deque[dict] = collections.deque(maxlen=RECENT_REPORTS)  # `prefixd why`
        self._seq = itertools.count()
        self._tick = itertools.count(1)
        self._store_touched = True
        self._ahead: PlanBuilder | None = None  # the next round's seatings made by admit_ahead
        self.draft_costs = RoundCosts()  # round time by rows, learned for the drafters' policy
        self.policy = RoundPolicy()  # client shares and busy rounds (docs/store.md, *Round policy*)
        # A run may end inside a chunk or span chunks only where no row's bits depend on the
        # chunking and a cut keeps nothing the round must capture.
        self._split_runs = info.invariant_rows and not info.lane_state_bytes and not info.lookahead
        self.admitter = Admitter(
            lanes=self.lanes, tables=self.tables, store=self.store, grid=config.grid,
            headroom_rows=config.decode_headroom_rows, max_context=self.max_context, cache=config.cache,
            invariant_rows=info.invariant_rows, lookahead=info.lookahead,
            disk=self.disk, order_key=self.policy.shares.order_key,
        )
        self.verifies = Verifies(tables=self.tables, free_pages=lambda n: self.admitter.free_pages(n, spare=()),
                                 observer=self.observer, max_context=self.max_context,
                                 invariant_rows=info.invariant_rows, costs=self.draft_costs)
        self.cuts = CutKeeper(store=self.store, info=info, observer=self.observer,
                              reuse_allowed=self.admitter.reuse_allowed)

    # -- public API -------------------------------------------------------------------

    def submit(self, req: StreamRequest) -> None:
        """Queue `req`; raises RequestError on bad input (nothing is queued then)."""
        validate_request(req, vocab_size=self.info.vocab_size, max_context=self.max_context,
                         pool_rows=self.info.num_pages * self.info.page_size)
        if req.stream_id in self._streams:
            raise ValueError(f"stream id {req.stream_id} is already in use")
        if req.chunk_starts and req.chunk_starts[0] == 0:
            req = dataclasses.replace(req, chunk_starts=tuple(req.chunk_starts[1:]))  # row 0 always starts one
        schedule = plan_schedule(len(req.tokens), req.chunk_starts, self.config.grid)
        stream = Stream(req=req, submit_s=self.clock(), seq=next(self._seq), schedule=schedule)
        stream.drafter = new_drafter(self.config.draft if req.draft else "off", req.tokens, self.config.draft_max)
        if self.config.cache and req.cache:
            stream.key, stream.note = make_key(
                req.tokens, cache_key=req.cache_key, namespace=req.namespace,
                images=[im.identity for im in req.images], lookahead=self.info.lookahead,
            )
        self._streams[req.stream_id] = stream
        self.admitter.waiting.push(stream)

    def cancel(self, stream_id: int, keep_rows: int | None = None) -> bool:
        """Mark a stream cancelled; it leaves its lane (or the queue) by the end of the next step().

        With `keep_rows` (a reply cut by a stop string: the next turn repeats only the text
        before the stop), the lane the stream leaves resident holds at most its first
        `keep_rows` rows; when the stream has already ended, its lane, if still resident and
        untouched since, is cut back now. Returns False if no such stream is waiting or running.
        """
        stream = self._streams.get(stream_id)
        if stream is None:
            if keep_rows is not None:
                self._trim_resident(stream_id, keep_rows)
            return False
        stream.cancelled = True
        stream.keep_rows = keep_rows
        return True

    def _trim_resident(self, stream_id: int, keep_rows: int) -> None:
        for lane in self.lanes:
            if lane.resident and lane.last_stream_id == stream_id:
                self.tables.truncate(lane, keep_rows)

    def step(self) -> list[Event]:
        """Run one lane round; returns the token and done events it produced, in order."""
        launched = self.launch()
        return self.land(launched, None if launched.plan.empty else self.run(launched))

    def launch(self) -> Launched:
        """Schedule the next round: drop cancels, admit, plan. Run its plan (`run`), then `land`."""
        t0 = self.clock()
        events: list[Event] = []
        if self.disk is not None:
            self.disk.poll()
        builder, self._ahead = self._ahead or PlanBuilder(), None
        planned = self._schedule(events, builder)
        if self.config.draft == "mtp":
            planned = ask_proposals(planned)
        for p in planned:
            if self.cuts.captures_at(p):
                builder.capture(p.lane.index, p.cut)
        loads, exports = self.disk.take_work() if self.disk is not None else ((), ())
        return Launched(builder.build(tuple(p.work for p in planned), loads, exports), planned, events, t0)

    def run(self, launched: Launched) -> RoundResult:
        """The device call of a launched round (any thread may make it; one round at a time)."""
        return self.device.run_round(launched.plan)

    def admit_ahead(self, launched: Launched) -> int:
        """While `launched` runs: seat waiting streams for the next round (see the module's
        *Overlap*). Streams the round runs, cancelled ones included, are left to `land()` and the
        next `launch()`; so is the disk tier's device work (a disk hit's load, a kept entry's
        export), which goes into the next plan. Returns how many streams were seated."""
        if launched.plan.empty:
            return 0
        self._ahead = self._ahead or PlanBuilder()
        return self._admit(self._ahead)

    def land(self, launched: Launched, result: RoundResult | None) -> list[Event]:
        """Take the device's answer to a launched round (None for an empty plan): append tokens,
        keep cuts, finish streams. Returns the round's events, in order."""
        plan, events = launched.plan, launched.events
        forward_s = 0.0
        if not plan.empty:
            if result is None:
                raise RuntimeError("a round with device work landed without the device's result")
            if self.disk is not None and (plan.loads or plan.exports):
                self.disk.landed(result.exported)
            forward_s = result.forward_s
            self.draft_costs.observe_round(plan, self.clock() - launched.t0)
            self._postprocess(launched.planned, plan, result, events)
        self._report_store()
        if plan.lanes or plan.stored or not (plan.loads or plan.exports):  # not a round of disk work alone
            busy = sum(1 for lane in self.lanes if lane.busy)
            self.observer.on_round(self.clock() - launched.t0, forward_s, plan.num_rows, busy,
                                   len(self.admitter.waiting))
        return events

    def abort(self, note: str) -> list[Event]:
        """End every running and waiting stream with finish_reason "error" and `note` (after a
        device failure); lanes are freed, not kept resident. The store keeps what it holds."""
        events: list[Event] = []
        self._ahead = None  # seatings made ahead belong to streams ended here
        if self.disk is not None:
            self.disk.drop_work()  # no device call after its failure
        for stream in sorted(self._streams.values(), key=lambda s: s.seq):
            if stream.lane is None:
                self.admitter.forget(stream)
                stream.note = note
                self._done(stream, "error", events)
            else:
                self._finish(stream, "error", events, note=note, keep=False)
        self._report_store()
        return events

    def close(self) -> None:
        """Run the disk tier's last exports, then release the device; call once no step() runs
        and none will."""
        if self.disk is not None and self.disk.has_work:
            self.step()  # a kept entry's export is an item of the round after the keep
        self.device.close()

    def pause_before_long(self) -> bool:
        """Whether the caller may wait a moment for new requests before the next round: a round
        with decode rows or a short prefill ran, and all that is left is long prefills (nothing
        decodes, nothing waiting or prefilling is short), so the next round would be theirs
        alone and a client whose short request just ended would find it in flight. True at
        most once after each busy spell (docs/store.md, *Round policy*)."""
        if not self.policy.pause_owed or not self._streams:
            return False  # checked before the streams: it is asked before every round
        short = self.config.short_prefill_rows
        if any(s.decoding or is_short(s, short) for s in self._streams.values()):
            return False
        self.policy.take_pause()
        return True

    @property
    def idle(self) -> bool:
        """Nothing running or waiting, and no disk load or export waiting for a round."""
        return not self._streams and (self.disk is None or not self.disk.has_work)

    def status(self) -> dict:
        """Lanes (busy/resident/free), waiting count, pages free/used, store stats."""
        return engine_status(self)

    def check_integrity(self) -> None:
        """Raise RuntimeError if lanes, streams, the store and page refcounts disagree."""
        check_engine(self, self._streams)

    # -- schedule ---------------------------------------------------------------------

    def _schedule(self, events: list[Event], builder: PlanBuilder) -> list[PlannedWork]:
        self._drop_cancelled(events, builder)
        self._admit(builder)
        busy = sorted((lane for lane in self.lanes if lane.busy), key=lambda lane: lane.stream.seq)
        decoding = [lane for lane in busy if lane.stream.decoding]
        order = self.policy.shares.order_key
        prefilling = sorted((lane for lane in busy if lane.stream.prefilling), key=lambda lane: order(lane.stream))
        self.verifies.offer_round(decoding)
        budget = RoundBudget(row_budget=self.config.round_row_budget, busy_rows=self.config.busy_prefill_rows,
                             short_rows=self.config.short_prefill_rows, grid=self.config.grid,
                             split=self._split_runs, lingering=self.policy.lingering,
                             first_token=builder.samples_stored, may_hold=self.policy.may_hold)
        planned, shape = plan_round(
            decoding,
            prefilling,
            page_size=self.info.page_size,
            budget=budget,
            room_for_row=self._room_for_row,
            cuts_of=lambda s: s.schedule.cuts,
            keep_cuts_of=self.cuts.publishes,
            drafts_of=self.verifies.drafts_for,
        )
        if not planned and decoding:
            # Every decoding lane needs a page and none is left: clear the store, else end the newest.
            if self.store is not None and self.store.clear():
                return self._schedule(events, builder)
            self._finish(decoding[-1].stream, "length", events, note=OUT_OF_PAGES_NOTE, keep=False)
            return self._schedule(events, builder)
        self.policy.planned(((p.stream, len(p.work.tokens)) for p in planned), shape)
        return planned

    def _admit(self, builder: PlanBuilder) -> int:
        """Seat what admission seats now, its device side into `builder`; returns how many."""
        seatings = self.admitter.admit()
        for seating in seatings:
            self._store_touched = True
            self._seat(seating, builder)
        return len(seatings)

    def _seat(self, seating: Seating, builder: PlanBuilder) -> None:
        """Bind a seated stream to its lane; the device side goes into this round's plan."""
        stream, resume = seating.stream, seating.resume
        copied = len(seating.page_copies) * self.info.kv_bytes_per_page
        if seating.restore is not None:
            copied += seating.restore.nbytes
        if copied:
            self.observer.on_snapshot_copy("restore", copied)
        stream.lane = seating.lane
        stream.admit_s = self.clock()
        stream.cache_result = seating.result
        stream.cached_tokens = resume
        stream.prefilled_tokens = stream.num_prompt - resume
        stream.chunks = stream.schedule.chunks(resume)
        builder.seat(seating)
        self.observer.on_admit(stream.admit_s - stream.submit_s)
        if seating.result != "off":
            self.observer.on_lookup(seating.result, stream.num_prompt, resume)
        reason = getattr(stream.diagnosis, "reason", None)
        if seating.result in ("miss", "off") and reason is not None:
            self.observer.on_miss(reason)

    def _room_for_row(self, lane: Lane) -> bool:
        rows = lane.num_rows + 1
        need = self.tables.pages_needed(lane, rows)
        return need == 0 or (self.admitter.free_pages(need, spare=()) and self.tables.grow(lane, rows))

    def _drop_cancelled(self, events: list[Event], builder: PlanBuilder) -> None:
        for stream in [s for s in self._streams.values() if s.cancelled]:
            if stream.lane is None:
                self.admitter.forget(stream)
                self._done(stream, "cancelled", events)
            elif builder.unseat(stream.lane):
                # seated ahead, nothing of it run yet: its lane's pages and state were never
                # made, so the lane is freed rather than kept resident
                self._finish(stream, "cancelled", events, keep=False)
            else:
                self._finish(stream, "cancelled", events)

    # -- postprocess ------------------------------------------------------------------

    def _postprocess(self, planned: list[PlannedWork], plan: RoundPlan, result: RoundResult,
                     events: list[Event]) -> None:
        if len(result.stored) != len(plan.stored) or len(result.captured) != len(plan.captures):
            raise RuntimeError(f"the device answered {len(result.stored)} stored samples and "
                               f"{len(result.captured)} captures for {len(plan.stored)} and {len(plan.captures)}")
        for res in result.stored:  # full hits: the first token, sampled from the stored row
            stream = self.lanes[res.lane].stream
            if stream is not None and res.error is not None:
                self._fail_lane(stream, res.error, events)
                continue
            if stream is None or len(res.sampled) != 1:
                raise RuntimeError(f"lane {res.lane}: a stored-row sample {res} for no seated stream")
            logprob = res.logprobs[0] if res.logprobs else None
            self._emit(stream, res.sampled[0], res.digests if stream.req.want_logits else None, events, logprob)
        by_lane = result.by_lane()
        captured = {c.lane: c.state for c in result.captured}
        for p in planned:
            lane, stream, work = p.lane, p.stream, p.work
            res = by_lane.get(lane.index)
            if res is not None and res.error is not None:
                self._fail_lane(stream, res.error, events)
                continue
            end = work.start + len(work.tokens)
            if work.prefill:
                lane.ids.extend(stream.key_tokens[work.start : end])
                lane.prefilled_upto = end
                stream.advance(end)
                if self.cuts.keeps(stream):
                    for cut in p.passed:  # spanned by the run: pages only (a family that splits runs has no state)
                        self._store_touched |= self.cuts.keep(lane, stream, cut, None, None)
                    if p.cut is not None:
                        logits = res.logits if res is not None else None
                        self._store_touched |= self.cuts.keep(lane, stream, p.cut, logits, captured.get(lane.index))
            else:
                self._postprocess_decode(lane, stream, work, res, events)
                offer_proposals(stream, res)
                continue
            if work.sample_rows:
                if res is None or len(res.sampled) != len(work.sample_rows):
                    raise RuntimeError(f"lane {lane.index}: the device sampled {res} for rows {work.sample_rows}")
                digests = res.digests if stream.req.want_logits else None
                self._emit(stream, res.sampled[0], digests, events, res.logprobs[0] if res.logprobs else None)
                offer_proposals(stream, res)

    def _postprocess_decode(self, lane: Lane, stream: Stream, work: LaneWork, res: LaneResult | None,
                            events: list[Event]) -> None:
        """Decode or verify rows: settle the verify, then emit the tokens the stream keeps."""
        num = self.verifies.settle(lane, stream, work, res)
        digests = res.digests if stream.req.want_logits else None
        for i, token in enumerate(res.sampled[:num]):
            logprob = res.logprobs[i] if res.logprobs else None
            self._emit(stream, token, None if digests is None else digests[i:i + 1], events, logprob)

    def _fail_lane(self, stream: Stream, error: str, events: list[Event]) -> None:
        """The device failed this lane alone: end its stream with "error"; the lane is freed, not
        kept resident, and its rows of this round reach neither the store nor a snapshot."""
        self._finish(stream, "error", events, note=f"this request failed in its lane round: {error}", keep=False)

    def _emit(self, stream: Stream, token: int, digests: tuple[str, ...] | None, events: list[Event],
              logprob: TokenLogprob | None = None) -> None:
        now = self.clock()
        if stream.first_token_s is None:
            stream.first_token_s = now
            self.observer.on_first_token(now - stream.submit_s, stream.cache_result)
        else:
            self.observer.on_token_gap(now - stream.last_token_s)
        stream.last_token_s = now
        stream.generated.append(token)
        events.append(TokenEvent(stream.stream_id, (token,), digests, None if logprob is None else (logprob,)))
        if token in stream.req.stop_ids:
            self._finish(stream, "stop", events)
        elif len(stream.generated) >= stream.req.max_tokens:
            self._finish(stream, "length", events)
        elif stream.num_prompt + len(stream.generated) >= self.max_context:
            self._finish(stream, "length", events, note=context_full_note(stream, self.max_context))

    def _finish(self, stream: Stream, reason: FinishReason, events: list[Event], note: str | None = None,
                keep: bool = True) -> None:
        """End a running stream; its lane stays resident when it may keep, else is freed."""
        lane = self.lanes[stream.lane]
        lane.stream = None
        if lane.restored is not None and self.store is not None:
            self.store.unpin(lane.restored)
        lane.restored = None
        if keep and self.admitter.reuse_allowed(stream) and not stream.prefilling:
            lane.resident = True
            lane.last_used = next(self._tick)
            lane.last_stream_id = stream.stream_id
            if stream.keep_rows is not None:
                self.tables.truncate(lane, stream.keep_rows)
        else:
            self.tables.release(lane)
        if note is not None:
            stream.note = note
        self._done(stream, reason, events)

    def _done(self, stream: Stream, reason: FinishReason, events: list[Event]) -> None:
        del self._streams[stream.stream_id]
        usage = stream.usage(self.clock())
        events.append(DoneEvent(stream.stream_id, reason, usage, stream.note))
        if stream.admit_s is not None:
            self.reports.append(cache_report(stream.stream_id, stream.req.namespace, usage))
        self.observer.on_done(reason, usage.prompt_tokens, usage.completion_tokens)

    def _report_store(self) -> None:
        """Feed evictions and, when the store may have changed this round, its bytes."""
        if self.store is None:
            return
        evictions = self.store.drain_evictions()
        for ev in evictions:
            self.observer.on_eviction(ev.reason, ev.nbytes)
        if evictions or self._store_touched:
            stats = self.store.stats()
            self.observer.on_store(stats.bytes, stats.budget_bytes)
        self._store_touched = False
