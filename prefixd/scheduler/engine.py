"""The engine: streams in, lane rounds out.

One `step()` is one lane round: `_schedule()` (drop cancels, admit, plan) ->
`device.run_round()` -> `_postprocess()` (append tokens, keep cuts, finish streams).
A lane the device reports failed (`LaneResult.error`) ends its stream alone; the round's other
lanes go on.
Single-threaded: the daemon calls it from one engine thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable

from prefixd.scheduler.admission import Admitter
from prefixd.scheduler.config import SchedulerConfig, store_budget_bytes
from prefixd.scheduler.device import Device
from prefixd.scheduler.draftpolicy import RoundCosts
from prefixd.scheduler.drafting import new_drafter
from prefixd.scheduler.events import EngineObserver, NullObserver
from prefixd.scheduler.lanes import Lane, PageTables, check_page_refs
from prefixd.scheduler.pages import PageAllocator
from prefixd.scheduler.planner import Schedule, plan_schedule
from prefixd.scheduler.records import DeviceRows, LaneResult, LaneWork, RoundPlan, RoundResult, TokenLogprob
from prefixd.scheduler.rounds import PlannedWork, plan_round
from prefixd.scheduler.store import PrefixStore, Snapshot, make_key
from prefixd.scheduler.streams import DoneEvent, Stream, StreamRequest, TokenEvent, context_full_note, validate_request

Event = TokenEvent | DoneEvent
OUT_OF_PAGES_NOTE = "stopped early: no KV pages left for another row"
# A resident lane of a non-invariant family keeps its state at the last cuts of its pass: the
# prompt's end and the chunk start before it (a chat's generation-prompt start, where the next
# turn's schedule cuts too).
RESIDENT_CUTS = 2


class Engine:
    """Schedules streams onto lanes and runs lane rounds on `device`.

    `store_factory(allocator=, page_size=, kv_bytes_per_page=, budget_bytes=, invariant_rows=,
    clock=)` builds the prefix store when `config.cache` (default `PrefixStore`); returning None
    leaves only resident lanes. `disk` (a `prefixd.disk.tier.DiskTier`, used only with a
    store) is written through on every keep and asked when a lookup misses RAM.
    """

    def __init__(
        self,
        device: Device,
        config: SchedulerConfig,
        *,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        store_factory: Callable[..., PrefixStore | None] | None = None,
        disk: Any = None,
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
        self.tables = PageTables(self.allocator, device, info.page_size)
        self.lanes = [Lane(i) for i in range(config.num_lanes)]
        self.store: PrefixStore | None = None
        if config.cache:
            self.store = (store_factory or PrefixStore)(
                allocator=self.allocator, page_size=info.page_size, kv_bytes_per_page=info.kv_bytes_per_page,
                budget_bytes=store_budget_bytes(info, config), invariant_rows=info.invariant_rows, clock=clock)
        self.disk = disk if self.store is not None else None
        if self.disk is not None:
            self.disk.attach(store=self.store, allocator=self.allocator, device=device)
        self._streams: dict[int, Stream] = {}
        self._schedules: dict[int, Schedule] = {}
        self._seq = itertools.count()
        self._tick = itertools.count(1)
        self._store_touched = True
        self._drafted = [0, 0]  # drafted, accepted tokens since start
        self.draft_costs = RoundCosts()  # round time by rows, learned for the drafters' policy
        self.admitter = Admitter(
            lanes=self.lanes, tables=self.tables, device=device, store=self.store,
            schedules=self._schedules, observer=self.observer, clock=clock, grid=config.grid,
            headroom_rows=config.decode_headroom_rows, max_context=self.max_context, cache=config.cache,
            disk=self.disk,
        )

    # -- public API -------------------------------------------------------------------

    def submit(self, req: StreamRequest) -> None:
        """Queue `req`; raises RequestError on bad input (nothing is queued then)."""
        validate_request(req, vocab_size=self.info.vocab_size, max_context=self.max_context,
                         pool_rows=self.info.num_pages * self.info.page_size)
        if req.stream_id in self._streams:
            raise ValueError(f"stream id {req.stream_id} is already in use")
        if req.chunk_starts and req.chunk_starts[0] == 0:
            req = dataclasses.replace(req, chunk_starts=tuple(req.chunk_starts[1:]))  # row 0 always starts one
        stream = Stream(req=req, submit_s=self.clock(), seq=next(self._seq))
        stream.drafter = new_drafter(self.config.draft if req.draft else "off", req.tokens, self.config.draft_max,
                                    self.draft_costs)
        if self.config.cache and req.cache:
            stream.key, stream.note = make_key(
                req.tokens, cache_key=req.cache_key, namespace=req.namespace, frame=req.frame,
                images=[im.identity for im in req.images], lookahead=self.info.lookahead,
            )
        self._streams[req.stream_id] = stream
        self._schedules[req.stream_id] = plan_schedule(len(req.tokens), req.chunk_starts, self.config.grid)
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
        t0 = self.clock()
        events: list[Event] = []
        if self.disk is not None:
            self.disk.poll()
        planned = self._schedule(events)
        plan = RoundPlan(tuple(p.work for p in planned))
        forward_s = 0.0
        if planned:
            result = self.device.run_round(plan)
            forward_s = result.forward_s
            self.draft_costs.observe_round(plan, result, self.clock() - t0)
            self._postprocess(planned, result, events)
        self._report_store()
        busy = sum(1 for lane in self.lanes if lane.busy)
        self.observer.on_round(self.clock() - t0, forward_s, plan.num_rows, busy, len(self.admitter.waiting))
        return events

    def abort(self, note: str) -> list[Event]:
        """End every running and waiting stream with finish_reason "error" and `note` (after a
        device failure); lanes are freed, not kept resident. The store keeps what it holds."""
        events: list[Event] = []
        for stream in sorted(self._streams.values(), key=lambda s: s.seq):
            if stream.lane is None:
                self.admitter.forget(stream)
                stream.note = note
                self._done(stream, "error", events)
            else:
                self._finish(stream, "error", events, note=note, keep=False)
        self._report_store()
        return events

    @property
    def idle(self) -> bool:
        """Nothing running or waiting."""
        return not self._streams

    def status(self) -> dict:
        """Lanes (busy/resident/free), waiting count, pages free/used, store stats."""
        lanes = []
        for lane in self.lanes:
            state = "busy" if lane.busy else "resident" if lane.resident else "free"
            entry: dict = {"lane": lane.index, "state": state, "rows": lane.num_rows, "pages": len(lane.pages)}
            if lane.stream is not None:
                entry["stream_id"] = lane.stream.stream_id
            lanes.append(entry)
        out = {
            "lanes": lanes,
            "lanes_busy": sum(1 for lane in self.lanes if lane.busy),
            "lanes_resident": sum(1 for lane in self.lanes if lane.resident),
            "waiting": len(self.admitter.waiting),
            "pages_free": self.allocator.num_free,
            "pages_used": self.allocator.num_used,
            "page_size": self.info.page_size,
            "max_context": self.max_context,
            "draft": {"mode": self.config.draft, "max": self.config.draft_max,
                      "drafted_tokens": self._drafted[0], "accepted_tokens": self._drafted[1]},
        }
        if self.store is not None:
            out["store"] = dataclasses.asdict(self.store.stats())
        if self.disk is not None:
            self.disk.poll()
            out["disk"] = dataclasses.asdict(self.disk.stats())
        return out

    def check_integrity(self) -> None:
        """Raise RuntimeError if lanes, streams, the store and page refcounts disagree."""
        for lane in self.lanes:
            stream = lane.stream
            if stream is not None and (stream.lane != lane.index or self._streams.get(stream.stream_id) is not stream):
                raise RuntimeError(f"lane {lane.index} and its stream disagree")
        running = sum(1 for lane in self.lanes if lane.busy)
        if running + len(self.admitter.waiting) != len(self._streams):
            raise RuntimeError(f"{len(self._streams)} streams, {running} running, {len(self.admitter.waiting)} waiting")
        store_pages = 0
        if self.store is not None:
            self.store.check_integrity()
            store_pages = self.store.stats().pages
        waiting_pages = [p for s in self.admitter.waiting if s.hit is not None for p in s.hit.pages]
        check_page_refs(self.allocator, self.lanes, self.info.page_size, waiting_pages, store_pages)

    # -- schedule ---------------------------------------------------------------------

    def _schedule(self, events: list[Event]) -> list[PlannedWork]:
        self._drop_cancelled(events)
        for seating in self.admitter.admit():
            self._store_touched = True
            if seating.first is not None:
                self._emit(seating.stream, seating.first, seating.logits, events, seating.logprob)
        busy = sorted((lane for lane in self.lanes if lane.busy), key=lambda lane: lane.stream.seq)
        decoding = [lane for lane in busy if not lane.stream.prefilling]
        prefilling = [lane for lane in busy if lane.stream.prefilling]
        _, planned = plan_round(
            decoding,
            prefilling,
            page_size=self.info.page_size,
            row_budget=self.config.round_row_budget,
            room_for_row=self._room_for_row,
            cuts_of=lambda s: self._schedules[s.stream_id].cuts,
            keep_cuts_of=self._publishes,
            drafts_of=self._drafts_for,
        )
        if not planned and busy:
            # Every busy lane decodes and none found a page: clear the store, else end the newest.
            if self.store is not None and self.store.clear():
                return self._schedule(events)
            self._finish(decoding[-1].stream, "length", events, note=OUT_OF_PAGES_NOTE, keep=False)
            return self._schedule(events)
        return planned

    def _room_for_row(self, lane: Lane) -> bool:
        rows = lane.num_rows + 1
        need = self.tables.pages_needed(lane, rows)
        return need == 0 or (self.admitter.free_pages(need, spare=()) and self.tables.grow(lane, rows))

    def _drafts_for(self, lane: Lane) -> tuple[int, ...]:
        """Tokens the lane's stream drafts this round: none without a drafter, past the stream's
        token or context limit, or when pages for the verify rows are short."""
        stream = lane.stream
        if stream is None or stream.drafter is None:
            return ()
        done = stream.num_prompt + len(stream.generated)
        limit = min(stream.req.max_tokens - len(stream.generated), self.max_context - done) - 1
        drafts = stream.drafter.propose(stream.generated, limit)
        rows = lane.num_rows + 1 + len(drafts)
        need = self.tables.pages_needed(lane, rows)
        if drafts and need and not (self.admitter.free_pages(need, spare=()) and self.tables.grow(lane, rows)):
            return ()
        return drafts

    def _keeps_cuts(self, stream: Stream) -> bool:
        """Whether `stream` keeps anything at its cuts (a snapshot, or the lane's state at its last cut)."""
        return self.admitter.reuse_allowed(stream) and (self.store is not None or not self.info.invariant_rows)

    def _publishes(self, stream: Stream) -> bool:
        """Whether `stream` publishes to the store (its chunks ending at cuts return their logits row)."""
        return self.store is not None and self.admitter.reuse_allowed(stream)

    def _drop_cancelled(self, events: list[Event]) -> None:
        for stream in [s for s in self._streams.values() if s.cancelled]:
            if stream.lane is None:
                self.admitter.forget(stream)
                self._done(stream, "cancelled", events)
            else:
                self._finish(stream, "cancelled", events)

    # -- postprocess ------------------------------------------------------------------

    def _postprocess(self, planned: list[PlannedWork], result: RoundResult, events: list[Event]) -> None:
        by_lane = result.by_lane()
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
                stream.next_chunk += 1
                if p.cut is not None and self._keeps_cuts(stream):
                    self._keep_cut(lane, stream, p.cut, res)
            else:
                self._postprocess_decode(lane, stream, work, res, events)
                continue
            if work.sample_rows:
                if res is None or len(res.sampled) != len(work.sample_rows):
                    raise RuntimeError(f"lane {lane.index}: the device sampled {res} for rows {work.sample_rows}")
                logprob = res.logprobs[0] if res.logprobs else None
                self._emit(stream, res.sampled[0], res.logits if stream.req.want_logits else None, events, logprob)

    def _postprocess_decode(self, lane: Lane, stream: Stream, work: LaneWork, res: LaneResult | None,
                            events: list[Event]) -> None:
        """Decode or verify rows: keep the rows whose tokens are emitted, emit them, trim pages
        that held only rejected rows, and count the draft."""
        if res is None or not 1 <= len(res.sampled) <= len(work.tokens):
            raise RuntimeError(f"lane {lane.index}: the device sampled {res} for {len(work.tokens)} rows")
        if work.drafts:
            accepted = len(res.sampled) - 1
            stream.draft_tokens += len(work.drafts)
            stream.accepted_tokens += accepted
            stream.drafter.record(len(work.drafts), accepted)
            self.observer.on_draft(len(work.drafts), accepted)
            self._drafted[0] += len(work.drafts)
            self._drafted[1] += accepted
        num = self._num_emitted(stream, res.sampled)
        lane.ids.extend(work.tokens[:num])  # row i gave token i; later rows were rejected or unneeded
        if self.info.invariant_rows:
            lane.prefilled_upto = work.start + num
        self.tables.trim(lane)
        rows = res.logits if stream.req.want_logits else None
        for i, token in enumerate(res.sampled[:num]):
            logprob = res.logprobs[i] if res.logprobs else None
            self._emit(stream, token, rows if rows is None or not work.drafts else rows[i:i + 1], events, logprob)

    def _num_emitted(self, stream: Stream, sampled: tuple[int, ...]) -> int:
        """How many of `sampled` the stream emits: up to and including one that ends it."""
        done = stream.num_prompt + len(stream.generated)
        for i, token in enumerate(sampled):
            if (token in stream.req.stop_ids or len(stream.generated) + i + 1 >= stream.req.max_tokens
                    or done + i + 1 >= self.max_context):
                return i + 1
        return len(sampled)

    def _fail_lane(self, stream: Stream, error: str, events: list[Event]) -> None:
        """The device failed this lane alone: end its stream with "error"; the lane is freed, not
        kept resident, and its rows of this round reach neither the store nor a snapshot."""
        self._finish(stream, "error", events, note=f"this request failed in its lane round: {error}", keep=False)

    def _keep_cut(self, lane: Lane, stream: Stream, cut: int, res: LaneResult | None) -> None:
        """A prefill chunk ended at a cut: capture the lane's state and publish the rows below it."""
        last_cuts = self._schedules[stream.stream_id].cuts[-RESIDENT_CUTS:]
        if self.store is None and cut not in last_cuts:
            return  # without a store only the last cuts are resumed, in place
        state = None
        if self.info.lane_state_bytes:
            state = self.device.capture(lane.index)
            self.observer.on_snapshot_copy("save", state.nbytes)
        if not self.info.invariant_rows and cut in last_cuts:
            lane.cut_states[cut] = state
        if self.store is not None:
            self._store_touched = True
            logits = res.logits if res is not None else None
            self.store.publish(stream.key, self._schedules[stream.stream_id], cut, lane.pages,
                               Snapshot(state=state, logits=logits), prefilled_upto=lane.prefilled_upto,
                               restored=lane.restored)

    def _emit(self, stream: Stream, token: int, logits: DeviceRows | None, events: list[Event],
              logprob: TokenLogprob | None = None) -> None:
        now = self.clock()
        if stream.first_token_s is None:
            stream.first_token_s = now
            self.observer.on_first_token(now - stream.submit_s, stream.cache_result)
        else:
            self.observer.on_token_gap(now - stream.last_token_s)
        stream.last_token_s = now
        stream.generated.append(token)
        events.append(TokenEvent(stream.stream_id, (token,), logits, None if logprob is None else (logprob,)))
        if token in stream.req.stop_ids:
            self._finish(stream, "stop", events)
        elif len(stream.generated) >= stream.req.max_tokens:
            self._finish(stream, "length", events)
        elif stream.num_prompt + len(stream.generated) >= self.max_context:
            self._finish(stream, "length", events, note=context_full_note(stream, self.max_context))

    def _finish(self, stream: Stream, reason: str, events: list[Event], note: str | None = None, keep: bool = True) -> None:
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

    def _done(self, stream: Stream, reason: str, events: list[Event]) -> None:
        del self._streams[stream.stream_id]
        del self._schedules[stream.stream_id]
        usage = stream.usage(self.clock())
        events.append(DoneEvent(stream.stream_id, reason, usage, stream.note))
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
