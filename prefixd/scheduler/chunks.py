"""Chunk planner: a request's prefill schedule and the hash that guards resumes at its cuts.

The schedule is a pure function of the prompt length n, the sorted chunk starts and the grid
G, so a hit and a miss run the same chunks after any resume point:

    without starts:  0 ---- G ---- 2G ---- 3G --- n      boundaries = cuts = (G, 2G, 3G, n)
    with starts:     0 ---- G -- s1 ---- s1+G -- s2 - n  boundaries = (G, s1, s1+G, s2, n)
                                                         cuts = (s1, s2, n)

With starts, a chunk longer than G is split every G rows counted from its own start, and a
grid point inside a request's chunk is never its resume point.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from array import array
from dataclasses import dataclass
from typing import Sequence

from prefixd.scheduler.records import ImageIdentity


@dataclass(frozen=True, slots=True)
class Schedule:
    """The prefill chunk boundaries and resume points of one request."""

    n: int
    grid: int
    starts: tuple[int, ...]
    boundaries: tuple[int, ...]  # chunk ends, ascending, last == n
    cuts: tuple[int, ...]  # where the store may keep a snapshot and a request may resume

    def chunks(self, resume: int) -> list[tuple[int, int]]:
        """The (start, end) row ranges to prefill after resuming at row `resume`.

        `resume` may be any row in [0, n] (a row-invariant family resumes anywhere); the
        rows after it are cut at the same boundaries as a cold run, so only the first
        chunk may be shorter.
        """
        if not 0 <= resume <= self.n:
            raise ValueError(f"resume {resume} outside [0, {self.n}]")
        out: list[tuple[int, int]] = []
        at = resume
        for end in self.boundaries[bisect.bisect_right(self.boundaries, resume):]:
            out.append((at, end))
            at = end
        return out

    def chunk_key(self, end: int) -> tuple[int, tuple[int, ...], int]:
        """What rows [0, end) were chunked by (end in (0, n]): the grid, the starts below `end`
        and the end of the chunk holding row end-1. Rows of a family that is not row-invariant
        are equal only under an equal chunk key."""
        if not 0 < end <= self.n:
            raise ValueError(f"end {end} outside (0, {self.n}]")
        chunk_end = self.boundaries[bisect.bisect_left(self.boundaries, end)]
        return self.grid, self.starts[:bisect.bisect_left(self.starts, end)], chunk_end

    def is_cut(self, row: int) -> bool:
        i = bisect.bisect_left(self.cuts, row)
        return i < len(self.cuts) and self.cuts[i] == row


def plan_schedule(n: int, starts: Sequence[int], grid: int) -> Schedule:
    """The schedule of a prompt of n rows with chunk starts `starts` (each in (0, n)).

    Raises ValueError on n <= 0, grid <= 0 or starts that are not strictly ascending in (0, n).
    """
    if n <= 0 or grid <= 0:
        raise ValueError(f"need n > 0 and grid > 0, got n={n} grid={grid}")
    st = tuple(int(s) for s in starts)
    if any(not 0 < s < n for s in st) or any(a >= b for a, b in zip(st, st[1:])):
        raise ValueError(f"chunk starts must ascend strictly inside (0, {n}): {st}")
    segment_starts = (0,) + st
    segment_ends = st + (n,)
    boundaries: list[int] = []
    for a, b in zip(segment_starts, segment_ends):
        boundaries.extend(range(a + grid, b, grid))
        boundaries.append(b)
    cuts = tuple(boundaries) if not st else st + (n,)
    return Schedule(n=n, grid=grid, starts=st, boundaries=tuple(boundaries), cuts=cuts)


class CutHasher:
    """`cut_hash` of one prompt at ascending cuts, hashing each token once.

    Asking for a cut below the last one asked starts over from row 0.
    """

    def __init__(self, tokens: Sequence[int], starts: Sequence[int], grid: int, *,
                 namespace: str = "", images: Sequence[ImageIdentity] = ()) -> None:
        self.tokens = tokens
        self.starts = tuple(starts)
        self.images = tuple(sorted(images, key=lambda i: i.at))
        ns = namespace.encode()
        self._head = struct.pack("<qq", grid, len(ns)) + ns
        self._h = hashlib.blake2b(self._head, digest_size=16)
        self._row = 0

    def at(self, cut: int) -> bytes:
        if not 0 <= cut <= len(self.tokens):
            raise ValueError(f"cut {cut} outside [0, {len(self.tokens)}]")
        if cut < self._row:
            self._h, self._row = hashlib.blake2b(self._head, digest_size=16), 0
        self._h.update(array("q", self.tokens[self._row:cut]).tobytes())
        self._row = cut
        h = self._h.copy()
        below = self.starts[:bisect.bisect_left(self.starts, cut)]
        h.update(struct.pack("<qq", cut, len(below)) + array("q", below).tobytes())
        for im in self.images:
            if im.at >= cut:
                break
            h.update(struct.pack("<qqqqq", im.at, im.tokens, im.gh, im.gw, len(im.hash)) + im.hash)
        return h.digest()


def cut_hash(
    tokens: Sequence[int],
    starts: Sequence[int],
    grid: int,
    cut: int,
    *,
    namespace: str = "",
    images: Sequence[ImageIdentity] = (),
) -> bytes:
    """A digest of everything the schedule and the rows below `cut` depend on.

    Covers the grid, namespace, the token ids below the cut, the chunk starts below
    the cut and the identity of every image that begins below it. Two requests whose hashes
    agree at a cut computed their rows below it with the same chunks. `starts` ascend.
    """
    return CutHasher(tokens, starts, grid, namespace=namespace, images=images).at(cut)
