"""Reuse identity: what must be equal for a cached row to be reused.

A row is reused only under the same token ids, the same lookahead ids past it, the same exact
image identities over it and the same namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from prefixd.scheduler.records import ImageIdentity

# (token ids of the rows and of the lookahead past them, images overlapping those rows)
RowsKey = tuple[tuple[int, ...], tuple[ImageIdentity, ...]]


@dataclass(frozen=True, slots=True)
class ReuseKey:
    """The identity of a prompt's rows: its token ids and what else the rows depend on.

    `images` are sorted by `at` and lie inside the prompt; `lookahead` is how many ids past
    a row key its state (a multi-token-prediction head keys row at-1 with token at).
    """

    tokens: tuple[int, ...]
    namespace: str = ""
    images: tuple[ImageIdentity, ...] = ()
    lookahead: int = 0

    def __post_init__(self) -> None:
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        prev_end = 0
        for im in self.images:
            if im.tokens <= 0 or im.at < prev_end or im.at + im.tokens > len(self.tokens):
                raise ValueError(f"image at {im.at} (+{im.tokens}) overlaps another or leaves "
                                 f"the prompt of {len(self.tokens)} rows")
            prev_end = im.at + im.tokens

    def rows_key(self, start: int, end: int) -> RowsKey:
        """Identity of rows [start, end) plus the lookahead ids past `end`."""
        stop = end + self.lookahead
        if stop > len(self.tokens):
            raise ValueError(f"rows up to {end} need lookahead to {stop} > {len(self.tokens)}")
        return self.tokens[start:stop], images_over(self.images, start, stop)

    def has_rows(self, end: int) -> bool:
        """True when rows up to `end` and their lookahead lie inside the key."""
        return end + self.lookahead <= len(self.tokens)


def images_over(images: Sequence[ImageIdentity], start: int, stop: int) -> tuple[ImageIdentity, ...]:
    """The images whose rows overlap [start, stop), in order."""
    return tuple(im for im in images if im.at < stop and im.at + im.tokens > start)


def agrees_from(a: ReuseKey, b: ReuseKey, row: int) -> bool:
    """True when neither key diverges from the other past `row`: on their common rows the
    ids and the images over them are equal (the namespace is compared by the caller)."""
    m = min(len(a.tokens), len(b.tokens))
    if row >= m:
        return True
    return a.tokens[row:m] == b.tokens[row:m] and images_over(a.images, row, m) == images_over(
        b.images, row, m
    )


def make_key(
    prompt: Sequence[int],
    *,
    cache_key: Sequence[int] | None = None,
    namespace: str = "",
    images: Sequence[ImageIdentity] = (),
    lookahead: int = 0,
) -> tuple[ReuseKey | None, str | None]:
    """The reuse key of a prompt, or (None, note) when the request may not reuse or keep.

    A `cache_key` of another length than the prompt reuses and keeps nothing: its rows do not
    line up with the prompt's, so the note says so and the engine runs the request cold.
    """
    ids = tuple(prompt) if cache_key is None else tuple(cache_key)
    if len(ids) != len(prompt):
        return None, (f"cache key has {len(ids)} tokens but the prompt has {len(prompt)}: "
                      "nothing reused or kept")
    ordered = tuple(sorted(images, key=lambda im: im.at))
    return ReuseKey(ids, namespace, ordered, lookahead), None
