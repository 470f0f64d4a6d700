"""Building one lane round: decode rows of every decoding lane, then prefill chunks in
admission order while the round's rows stay within the row budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from prefixd.scheduler.lanes import Lane, pages_for
from prefixd.scheduler.records import ImageRows, LaneWork, RoundPlan
from prefixd.scheduler.streams import Stream


@dataclass(frozen=True, slots=True)
class PlannedWork:
    """A lane's work in the round and whether it ends at a cut the store may keep."""

    lane: Lane
    stream: Stream
    work: LaneWork
    cut: int | None  # the schedule cut this prefill chunk ends at, if any


def images_over(images: Sequence[ImageRows], start: int, end: int) -> tuple[ImageRows, ...]:
    """The images whose rows overlap [start, end)."""
    return tuple(im for im in images if im.identity.at < end and start < im.identity.at + im.identity.tokens)


def decode_work(lane: Lane, stream: Stream, page_size: int, drafts: tuple[int, ...] = ()) -> LaneWork:
    """One decode row: feed the last sampled token at the lane's next row, sample after it;
    with `drafts`, also one verify row per drafted token, each sampled."""
    row = lane.num_rows
    rows = tuple(range(1 + len(drafts)))
    return LaneWork(
        lane=lane.index,
        start=row,
        tokens=(stream.generated[-1], *drafts),
        page_table=tuple(lane.pages[: pages_for(row + len(rows), page_size)]),
        prefill=False,
        sample_rows=rows,
        digest_rows=rows if stream.req.want_logits else (),
        drafts=drafts,
    )


def prefill_work(lane: Lane, stream: Stream, page_size: int, cuts: Sequence[int], keep_cuts: bool) -> PlannedWork:
    """The stream's next prefill chunk; the last chunk samples the first token.

    With `keep_cuts`, the last chunk also returns its logits row for the snapshot at the
    prompt's end; with `want_logits`, the digest of the row it samples from. Earlier cuts keep no logits row: a chat prompt ends with its generation
    prompt, never at a message start, so only a request repeating the whole prompt can use one.
    """
    start, end = stream.chunks[stream.next_chunk]
    if start != lane.num_rows:
        raise RuntimeError(f"lane {lane.index}: chunk starts at {start} but {lane.num_rows} rows are written")
    last = end - start - 1
    final = stream.next_chunk == len(stream.chunks) - 1
    cut = end if end in cuts else None
    sample_rows = (last,) if final else ()
    work = LaneWork(
        lane=lane.index,
        start=start,
        tokens=tuple(stream.req.tokens[start:end]),
        page_table=tuple(lane.pages[: pages_for(end, page_size)]),
        prefill=True,
        sample_rows=sample_rows,
        logits_rows=(last,) if final and keep_cuts else (),
        images=images_over(stream.req.images, start, end),
        digest_rows=sample_rows if stream.req.want_logits else (),
    )
    return PlannedWork(lane, stream, work, cut)


def plan_round(
    decoding: Sequence[Lane],
    prefilling: Sequence[Lane],
    *,
    page_size: int,
    row_budget: int,
    room_for_row: Callable[[Lane], bool],
    cuts_of: Callable[[Stream], Sequence[int]],
    keep_cuts_of: Callable[[Stream], bool],
    drafts_of: Callable[[Lane], tuple[int, ...]] = lambda lane: (),
) -> tuple[RoundPlan, list[PlannedWork]]:
    """Plan one round.

    `decoding` lanes each add one row when `room_for_row(lane)` finds a page for it (a lane
    without room sits this round out), plus a verify row per token `drafts_of(lane)` drafts
    (it finds pages for them itself, or drafts nothing). `prefilling` lanes, in admission order, each add their
    next whole chunk while rows stay within `row_budget`; the first chunk always goes.
    """
    planned: list[PlannedWork] = []
    rows = 0
    for lane in decoding:
        assert lane.stream is not None, f"lane {lane.index} decodes without a stream"
        if room_for_row(lane):
            drafts = drafts_of(lane)
            planned.append(PlannedWork(lane, lane.stream, decode_work(lane, lane.stream, page_size, drafts), None))
            rows += 1 + len(drafts)
    num_chunks = 0
    for lane in prefilling:
        assert lane.stream is not None, f"lane {lane.index} prefills without a stream"
        stream = lane.stream
        start, end = stream.chunks[stream.next_chunk]
        if num_chunks > 0 and rows + (end - start) > row_budget:
            break  # whole chunks only, in admission order
        planned.append(prefill_work(lane, stream, page_size, cuts_of(stream), keep_cuts_of(stream)))
        rows += end - start
        num_chunks += 1
    return RoundPlan(tuple(p.work for p in planned)), planned
