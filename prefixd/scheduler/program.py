"""Building one round's program: the device items the engine decides while it schedules.

Admission's seatings, the planner's lane work and the captures at cuts all land in one
`RoundPlan`; `RoundPlan`'s docstring gives the order the device runs them in. Nothing here
talks to the device.
"""

from __future__ import annotations

from prefixd.scheduler.admission import Seating
from prefixd.scheduler.records import (Capture, LaneWork, PageCopy, Restore, RoundPlan, SamplerSetup,
                                       StoredSample)


class PlanBuilder:
    """Collects one round's items in the order they are decided; `build()` freezes them."""

    def __init__(self) -> None:
        self._resets: list[int] = []
        self._restores: list[Restore] = []
        self._copies: list[PageCopy] = []
        self._samplers: list[SamplerSetup] = []
        self._stored: list[StoredSample] = []
        self._captures: list[Capture] = []
        self._seated: set[int] = set()

    def seat(self, seating: Seating) -> None:
        """The device side of a seating: reset or restore, page copies, a fresh sampler, and for
        a full hit the first token from the stored row."""
        lane, req = seating.lane, seating.stream.req
        if lane in self._seated:
            raise RuntimeError(f"lane {lane} seated twice in one round")
        self._seated.add(lane)
        if seating.reset:
            self._resets.append(lane)
        elif seating.restore is not None:
            self._restores.append(Restore(lane, seating.restore))
        self._copies.extend(seating.page_copies)
        self._samplers.append(SamplerSetup(lane, req.sampling, req.tokens))
        if seating.stored_logits is not None:
            self._stored.append(StoredSample(lane, seating.stored_logits, 0, digest=req.want_logits))

    def capture(self, lane: int, cut: int) -> None:
        """Capture the lane's state after the forward (its chunk ends at `cut`)."""
        self._captures.append(Capture(lane, cut))

    def build(self, lanes: tuple[LaneWork, ...]) -> RoundPlan:
        return RoundPlan(lanes=lanes, resets=tuple(self._resets), restores=tuple(self._restores),
                         page_copies=tuple(self._copies), samplers=tuple(self._samplers),
                         stored=tuple(self._stored), captures=tuple(self._captures))
