"""Building one round's plan (`RoundPlan`): the device items the engine decides while it schedules.

Admission's seatings, the planner's lane work and the captures at cuts all land in one
`RoundPlan`; `RoundPlan`'s docstring gives the order the device runs them in. Nothing here
talks to the device.
"""

from __future__ import annotations

from prefixd.scheduler.admission import Seating
from prefixd.scheduler.records import (Capture, DiskLoad, LaneWork, PageExport, Restore, RoundPlan, SamplerSetup,
                                       StoredSample)


class PlanBuilder:
    """Collects one round's items in the order they are decided; `build()` freezes them."""

    def __init__(self) -> None:
        self._seatings: dict[int, Seating] = {}  # by lane, in the order seated
        self._captures: list[Capture] = []

    def seat(self, seating: Seating) -> None:
        """The device side of a seating: reset or restore, page copies, a fresh sampler, and for
        a full hit the first token from the stored row."""
        if seating.lane in self._seatings:
            raise RuntimeError(f"lane {seating.lane} seated twice in one round")
        self._seatings[seating.lane] = seating

    def unseat(self, lane: int) -> bool:
        """Take back the device side of the lane's seating (its stream left before the round
        ran; the engine frees the lane). Returns False if the lane was not seated here."""
        return self._seatings.pop(lane, None) is not None

    @property
    def samples_stored(self) -> bool:
        """Whether a seating here is a full hit, its first token sampled from the stored row."""
        return any(s.stored_logits is not None for s in self._seatings.values())

    def capture(self, lane: int, cut: int) -> None:
        """Capture the lane's state after the forward (its chunk ends at `cut`)."""
        self._captures.append(Capture(lane, cut))

    def build(self, lanes: tuple[LaneWork, ...], loads: tuple[DiskLoad, ...] = (),
              exports: tuple[PageExport, ...] = ()) -> RoundPlan:
        seatings = self._seatings.values()
        return RoundPlan(
            lanes=lanes, loads=loads, exports=exports,
            resets=tuple(s.lane for s in seatings if s.reset),
            restores=tuple(Restore(s.lane, s.restore) for s in seatings if not s.reset and s.restore is not None),
            page_copies=tuple(c for s in seatings for c in s.page_copies),
            samplers=tuple(SamplerSetup(s.lane, s.stream.req.sampling, s.stream.req.tokens) for s in seatings),
            stored=tuple(StoredSample(s.lane, s.stored_logits, 0, digest=s.stream.req.want_logits)
                         for s in seatings if s.stored_logits is not None),
            captures=tuple(self._captures))
