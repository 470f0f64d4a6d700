"""Typed records that cross the scheduler/gpu boundary.

The scheduler builds a `RoundPlan`, the device runs it and answers with a `RoundResult`.
Everything here is plain Python; device tensors travel as opaque `DeviceRows` /
`DeviceState` objects that only `gpu/` looks inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a stream picks its next token. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    seed: int | None = None  # None: a seed drawn once at stream start

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True, slots=True)
class ImageIdentity:
    """The exact identity of one image embedding placed over prompt rows [at, at + tokens)."""

    at: int
    tokens: int
    gh: int
    gw: int
    hash: bytes


@dataclass(frozen=True, slots=True)
class ImageRows:
    """An image embedding: `tokens` float rows replacing the placeholder rows at `identity.at`.

    `rows` is opaque here (a memoryview / numpy array of shape (tokens, hidden) float32);
    gpu/ turns it into the input embeddings of those rows.
    """

    identity: ImageIdentity
    rows: Any


@dataclass(frozen=True, slots=True)
class LaneWork:
    """One lane's share of a round.

    Rows are positions [start, start + len(tokens)). `page_table` lists the lane's pages in
    order and covers every row up to start + len(tokens); the device writes this work's KV
    into those pages and attends only through them.
    """

    lane: int
    start: int
    tokens: tuple[int, ...]
    page_table: tuple[int, ...]
    prefill: bool  # True: a prefill chunk; False: 1+k decode/verify rows
    sample_rows: tuple[int, ...] = ()  # row indices (0-based in tokens) to sample a token after
    logits_rows: tuple[int, ...] = ()  # row indices whose float32 logits come back
    images: tuple[ImageRows, ...] = ()  # embeddings overlapping these rows


@dataclass(frozen=True, slots=True)
class RoundPlan:
    lanes: tuple[LaneWork, ...]

    @property
    def num_rows(self) -> int:
        return sum(len(w.tokens) for w in self.lanes)


class DeviceRows(Protocol):
    """Opaque device-side logits rows (gpu/ uses a float32 tensor of shape (n, vocab))."""

    @property
    def nbytes(self) -> int: ...


class DeviceState(Protocol):
    """Opaque per-lane state captured at a cut (recurrent + conv state, draft carry).

    Attention-only families capture an empty state with nbytes == 0.
    """

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class LaneResult:
    lane: int
    sampled: tuple[int, ...] = ()  # one token per entry of LaneWork.sample_rows
    logits: DeviceRows | None = None  # rows for LaneWork.logits_rows, in that order
    # Set when this lane alone failed (non-finite logits, a sampler error, a bad image): the
    # lane's rows of this round are unusable, `sampled` and `logits` are empty, and every other
    # lane of the round is unaffected.
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RoundResult:
    lanes: tuple[LaneResult, ...]
    forward_s: float = 0.0  # time spent inside the model forward
    extra: dict[str, float] = field(default_factory=dict)

    def by_lane(self) -> dict[int, LaneResult]:
        return {r.lane: r for r in self.lanes}
