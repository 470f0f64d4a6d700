"""Building one lane round: decode rows of every decoding lane, then prefill runs, least
served client first, within the round's row budget (docs/store.md, *Round policy*).

A lane's prefill run is a stretch of its schedule's rows: where the family may cut rows
anywhere (`RoundBudget.split`) it may end inside a chunk or span several whole chunks;
elsewhere it is exactly one whole chunk. Either way the chunk boundaries are the schedule's,
a pure function of the prompt, its starts and the grid; the budget only decides how many of
those rows a lane runs this round.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Sequence

from prefixd.scheduler.lanes import Lane, pages_for
from prefixd.scheduler.records import ImageRows, LaneWork, RoundPlan
from prefixd.scheduler.streams import Stream


@dataclass(frozen=True, slots=True)
class RoundBudget:
    """How many rows a round gives prefills (`SchedulerConfig` holds the numbers).

    `row_budget` bounds the round's rows; `grid` one lane's run. A round is *busy* when it
    carries decode rows or a short prefill (a stream prefilling at most `short_rows` rows), or
    `lingering` says a recent round did: long prefills then share `busy_rows` rows. A round
    that gives a stream its first token (a short prefill, or `first_token`: admission seated a
    full hit, sampled from its stored row) holds long prefills back altogether when `may_hold`
    (the round before did not). `split`: the family's rows are invariant at every row and
    nothing but pages is kept at a cut, so a run may end inside a chunk or span chunks.
    """

    row_budget: int
    busy_rows: int
    short_rows: int
    grid: int
    split: bool
    lingering: bool = False
    first_token: bool = False
    may_hold: bool = True


@dataclass(frozen=True, slots=True)
class RoundShape:
    """What the round policy remembers of a planned round (`RoundPolicy.planned`)."""

    busy: bool  # it carried decode rows or a short prefill
    held: bool  # it gave a first token and held long prefills that wanted rows back


@dataclass(frozen=True, slots=True)
class PlannedWork:
    """A lane's work in the round and whether it ends at a cut the store may keep."""

    lane: Lane
    stream: Stream
    work: LaneWork
    cut: int | None  # the schedule cut this prefill run ends at, if any
    passed: tuple[int, ...] = ()  # cuts strictly inside the run (only where runs span chunks)


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


def run_end(stream: Stream, room: int, grid: int, *, span: bool, split: bool) -> int | None:
    """Where the stream's next prefill run ends if it may take `room` rows (at most `grid`):
    at the end of its next chunk, with `span` of the last whole chunk that fits; when not even
    the next chunk fits, with `split` inside it, else None."""
    start, end = stream.chunks[stream.next_chunk]
    limit = start + min(room, grid)
    if end > limit:
        return limit if split and limit > start else None
    if span:
        for _, later in stream.chunks[stream.next_chunk + 1:]:
            if later > limit:
                break
            end = later
    return end


def prefill_work(lane: Lane, stream: Stream, end: int, page_size: int, cuts: Sequence[int],
                 keep_cuts: bool) -> PlannedWork:
    """The stream's prefill rows [its next row, `end`); a run ending the prompt samples the first token.

    With `keep_cuts`, the last run also returns its logits row for the snapshot at the
    prompt's end; with `want_logits`, the digest of the row it samples from. Earlier cuts keep no logits row: a chat prompt ends with its generation
    prompt, never at a message start, so only a request repeating the whole prompt can use one.
    """
    start = stream.chunks[stream.next_chunk][0]
    if start != lane.num_rows:
        raise RuntimeError(f"lane {lane.index}: chunk starts at {start} but {lane.num_rows} rows are written")
    last = end - start - 1
    final = end == stream.num_prompt
    cut = end if end in cuts else None
    passed = tuple(cuts[bisect.bisect_right(cuts, start):bisect.bisect_left(cuts, end)])
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
    return PlannedWork(lane, stream, work, cut, passed)


def is_short(stream: Stream, short_rows: int) -> bool:
    """A short prefill: the stream prefills at most `short_rows` rows in all."""
    return stream.num_prompt - stream.cached_tokens <= short_rows


def plan_round(
    decoding: Sequence[Lane],
    prefilling: Sequence[Lane],
    *,
    page_size: int,
    budget: RoundBudget,
    room_for_row: Callable[[Lane], bool],
    cuts_of: Callable[[Stream], Sequence[int]],
    keep_cuts_of: Callable[[Stream], bool],
    drafts_of: Callable[[Lane], tuple[int, ...]] = lambda lane: (),
) -> tuple[list[PlannedWork], RoundShape]:
    """Plan one round; returns its lane work and its shape (what the round policy remembers:
    whether it was busy, which makes the rounds after it busy too, and whether it held long
    prefills back, which the next round may not).

    `decoding` lanes each add one row when `room_for_row(lane)` finds a page for it (a lane
    without room sits this round out), plus a verify row per token `drafts_of(lane)` drafts
    (it finds pages for them itself, or drafts nothing). `prefilling` lanes come in the order
    they are served (least served client first, FIFO within one). Short prefills go first,
    each its whole next run while the round's rows stay within `row_budget`; then long ones,
    within `busy_rows` of them in a busy round, and none in a round that gives a first token
    while `may_hold`. Otherwise, however full the round, its first short prefill and its first
    long prefill each still run: a whole chunk, or where runs split, at most `busy_rows` rows.
    """
    planned: list[PlannedWork] = []
    rows = 0
    for lane in decoding:
        assert lane.stream is not None, f"lane {lane.index} decodes without a stream"
        if room_for_row(lane):
            drafts = drafts_of(lane)
            planned.append(PlannedWork(lane, lane.stream, decode_work(lane, lane.stream, page_size, drafts), None))
            rows += 1 + len(drafts)
    shorts = [lane for lane in prefilling if is_short(lane.stream, budget.short_rows)]
    longs = [lane for lane in prefilling if not is_short(lane.stream, budget.short_rows)]
    short_work = bool(planned) or bool(shorts)
    hold = budget.may_hold and (budget.first_token or bool(shorts))
    long_left = budget.busy_rows if short_work or budget.lingering else budget.row_budget
    for group, is_long in ((shorts, False), (longs, True)):
        if is_long and hold:
            break  # the first token goes out in a round of its own work and the decode rows
        ran = False
        for lane in group:
            stream = lane.stream
            assert stream is not None, f"lane {lane.index} prefills without a stream"
            room = budget.row_budget - rows
            if is_long:
                room = min(room, long_left)
            end = run_end(stream, room, budget.grid, span=budget.split, split=budget.split and is_long)
            if end is None and not ran:
                end = _forced_end(stream, budget, is_long)
            if end is None:
                break  # in serving order: a later lane does not overtake one that waits
            p = prefill_work(lane, stream, end, page_size, cuts_of(stream), keep_cuts_of(stream))
            planned.append(p)
            num = len(p.work.tokens)
            rows += num
            if is_long:
                long_left -= num
            ran = True
    return planned, RoundShape(busy=short_work, held=hold and bool(longs))


def _forced_end(stream: Stream, budget: RoundBudget, is_long: bool) -> int:
    """The run a prefill gets however full the round: its next whole chunk, or for a long
    prefill where runs split, at most `busy_rows` rows of it."""
    start, end = stream.chunks[stream.next_chunk]
    if budget.split and is_long:
        return min(end, start + budget.busy_rows)
    return end
