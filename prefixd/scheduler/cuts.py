"""Keeping a lane's rows at the cuts its prefill chunks end at: which rounds capture state,
and what the store and the lane keep once the round is back."""

from __future__ import annotations

from typing import Callable

from prefixd.scheduler.device import DeviceInfo
from prefixd.scheduler.observer import EngineObserver
from prefixd.scheduler.lanes import Lane
from prefixd.scheduler.records import DeviceRows, DeviceState
from prefixd.scheduler.rounds import PlannedWork
from prefixd.scheduler.store import PrefixStore, Snapshot
from prefixd.scheduler.streams import Stream

# A resident lane of a non-invariant family keeps its state at the last cuts of its pass: the
# prompt's end and the chunk start before it (a chat's generation-prompt start, where the next
# turn's schedule cuts too).
RESIDENT_CUTS = 2


class CutKeeper:
    """Decides captures when a round is planned and keeps what they captured when it is back."""

    def __init__(self, *, store: PrefixStore | None, info: DeviceInfo, observer: EngineObserver,
                 reuse_allowed: Callable[[Stream], bool]) -> None:
        self.store = store
        self.info = info
        self.observer = observer
        self.reuse_allowed = reuse_allowed

    def keeps(self, stream: Stream) -> bool:
        """Whether `stream` keeps anything at its cuts (a snapshot, or the lane's state at its last cut)."""
        return self.reuse_allowed(stream) and (self.store is not None or not self.info.invariant_rows)

    def publishes(self, stream: Stream) -> bool:
        """Whether `stream` publishes to the store (its chunks ending at cuts return their logits row)."""
        return self.store is not None and self.reuse_allowed(stream)

    def captures_at(self, p: PlannedWork) -> bool:
        """Whether the round captures the lane's state after `p`'s chunk, for `keep`."""
        if p.cut is None or not self.info.lane_state_bytes or not self.keeps(p.stream):
            return False
        return self.store is not None or p.cut in p.stream.schedule.cuts[-RESIDENT_CUTS:]

    def keep(self, lane: Lane, stream: Stream, cut: int, logits: DeviceRows | None,
             state: DeviceState | None) -> bool:
        """A prefill chunk ended at a cut: keep the state the round captured there (on the lane,
        at its last cuts) and publish the rows below it. Returns True if the store was offered them."""
        last_cuts = stream.schedule.cuts[-RESIDENT_CUTS:]
        if self.store is None and cut not in last_cuts:
            return False  # without a store only the last cuts are resumed, in place
        if self.info.lane_state_bytes:
            if state is None:
                raise RuntimeError(f"lane {lane.index}: no state captured at cut {cut}")
            self.observer.on_snapshot_copy("save", state.nbytes)
        if not self.info.invariant_rows and cut in last_cuts:
            lane.cut_states[cut] = state
        if self.store is None:
            return False
        self.store.publish(stream.key, stream.schedule, cut, lane.pages, Snapshot(state=state, logits=logits),
                           prefilled_upto=lane.prefilled_upto, restored=lane.restored)
        return True
