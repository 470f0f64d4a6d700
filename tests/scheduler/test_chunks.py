"""Chunk planner: boundaries, cuts, resumes and the hash below a cut."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixd.scheduler.chunks import Schedule, cut_hash, plan_schedule
from prefixd.scheduler.records import ImageIdentity

TOKS = tuple(range(50, 70))


def test_without_starts_boundaries_and_cuts_are_the_grid_multiples_below_n_and_n() -> None:
    assert plan_schedule(10, (), 4) == Schedule(10, 4, (), (4, 8, 10), (4, 8, 10))
    assert plan_schedule(8, (), 4).boundaries == (4, 8)
    assert plan_schedule(3, (), 4).boundaries == (3,)


def test_with_starts_chunks_split_every_grid_rows_from_their_own_start() -> None:
    s = plan_schedule(20, (3, 15), 4)
    assert s.boundaries == (3, 7, 11, 15, 19, 20)
    assert s.cuts == (3, 15, 20)


def test_a_grid_point_inside_a_requests_chunk_is_never_its_cut() -> None:
    s = plan_schedule(20, (6,), 4)
    assert s.boundaries == (4, 6, 10, 14, 18, 20)
    assert not s.is_cut(4) and not s.is_cut(8) and not s.is_cut(10)
    assert s.is_cut(6) and s.is_cut(20)


def test_chunks_after_a_resume_follow_the_cold_boundaries() -> None:
    s = plan_schedule(20, (3, 15), 4)
    assert s.chunks(0) == [(0, 3), (3, 7), (7, 11), (11, 15), (15, 19), (19, 20)]
    assert s.chunks(15) == [(15, 19), (19, 20)]
    assert s.chunks(9) == [(9, 11), (11, 15), (15, 19), (19, 20)]
    assert s.chunks(20) == []
    with pytest.raises(ValueError):
        s.chunks(21)


def test_bad_starts_and_sizes_raise() -> None:
    for n, starts, g in ((10, (0,), 4), (10, (10,), 4), (10, (5, 5), 4), (10, (6, 5), 4),
                         (0, (), 4), (10, (), 0)):
        with pytest.raises(ValueError):
            plan_schedule(n, starts, g)


def test_cut_hash_covers_tokens_and_starts_below_the_cut_only() -> None:
    base = cut_hash(TOKS, (3,), 4, 10)
    assert cut_hash(TOKS, (3, 12), 4, 10) == base  # a start past the cut does not count
    assert cut_hash(TOKS[:10] + (1,) * 10, (3,), 4, 10) == base  # nor tokens past it
    assert cut_hash(TOKS, (), 4, 10) != base
    assert cut_hash(TOKS, (5,), 4, 10) != base
    assert cut_hash(TOKS[:9] + (1,) + TOKS[10:], (3,), 4, 10) != base
    assert cut_hash(TOKS, (3,), 8, 10) != base


def test_cut_hash_covers_namespace_and_images_below_the_cut() -> None:
    im = ImageIdentity(at=4, tokens=2, gh=1, gw=2, hash=b"a")
    base = cut_hash(TOKS, (), 4, 8, images=[im])
    assert base != cut_hash(TOKS, (), 4, 8)
    assert base != cut_hash(TOKS, (), 4, 8, images=[ImageIdentity(4, 2, 1, 2, b"b")])
    assert base != cut_hash(TOKS, (), 4, 8, images=[im], namespace="x")
    later = ImageIdentity(at=9, tokens=2, gh=1, gw=2, hash=b"z")
    assert cut_hash(TOKS, (), 4, 8, images=[im, later]) == base


@st.composite
def _requests(draw: st.DrawFn) -> tuple[int, tuple[int, ...], int]:
    n = draw(st.integers(1, 80))
    g = draw(st.integers(1, 16))
    starts = draw(st.lists(st.integers(1, max(1, n - 1)), unique=True, max_size=6)) if n > 1 else []
    return n, tuple(sorted(s for s in starts if 0 < s < n)), g


@given(_requests(), st.data())
def test_schedules_cover_the_prompt_in_chunks_of_at_most_grid_rows(
        req: tuple[int, tuple[int, ...], int], data: st.DataObject) -> None:
    n, starts, g = req
    s = plan_schedule(n, starts, g)
    assert s.boundaries[-1] == n and list(s.boundaries) == sorted(set(s.boundaries))
    assert set(starts) <= set(s.boundaries) and set(s.cuts) <= set(s.boundaries)
    assert s.cuts == (starts + (n,) if starts else s.boundaries)
    chunks = s.chunks(0)
    assert all(0 < b - a <= g for a, b in chunks)
    r = data.draw(st.integers(0, n))
    tail = s.chunks(r)
    assert [b for _, b in tail] == [b for b in s.boundaries if b > r]
    assert (tail[0][0] if tail else n) == r
