"""Typed records that cross the scheduler/gpu boundary.

The scheduler builds a `RoundPlan`, the device runs it and answers with a `RoundResult`.
Everything here is plain Python; device tensors travel as opaque `DeviceRows` /
`DeviceState` objects that only `gpu/` looks inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol


_MAX_FLOAT = 1.7976931348623157e308

# Enumerations that travel as these strings (the wire, the metrics' labels, the status).
CacheResult = Literal["miss", "hit", "shared", "resident", "off"]  # what a prompt reused; "off": it may not
FinishReason = Literal["stop", "length", "cancelled", "error"]  # why a stream ended
DraftMode = Literal["mtp", "ngram", "off"]  # the device's draft head, prompt lookup, or no drafting


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a stream picks its next token. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    seed: int | None = None  # None: a seed drawn once at stream start
    grammar: str | None = None  # an llguidance grammar the output must match (None: free)
    logprobs: int | None = None  # per sampled token: its logprob and this many top alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def problem(self) -> str | None:
        """Why these parameters cannot be served, or None. Every value this accepts is served
        (gpu/sampling.py keeps a finite row drawable at each edge)."""
        if not 0.0 <= self.temperature <= _MAX_FLOAT:
            return f"temperature must be a finite number >= 0, got {self.temperature}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p}"
        if not 0.0 < self.repetition_penalty <= _MAX_FLOAT:
            return f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
        if self.seed is not None and not 0 <= self.seed < 2**64:
            return f"seed must be in [0, 2**64), got {self.seed}"
        return None


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
    """One lane's rows in the round's forward.

    Rows are positions [start, start + len(tokens)). `page_table` lists the lane's pages in
    order and covers every row up to start + len(tokens); the device writes this work's KV
    into those pages and attends only through them.

    Verify rows: with `drafts`, tokens are (last accepted token, *drafts) and every row is
    sampled; the device samples row i only while rows before it matched their draft, returns
    the accepted drafts plus one more token in `sampled` (1..k+1 tokens), and rolls the lane's
    state back to the last accepted row itself, in the same round (a later step that touches
    the lane waits for that copy).

    Draft head (`DeviceInfo.draft_head`): the device runs its MTP head over every lane's kept
    rows; with `propose` > 0 and a token sampled, the result also carries up to `propose`
    tokens the head predicts after it (`LaneResult.proposals`), for the next round to verify.
    """

    lane: int
    start: int
    tokens: tuple[int, ...]
    page_table: tuple[int, ...]
    prefill: bool  # True: a prefill chunk; False: 1+k decode/verify rows
    sample_rows: tuple[int, ...] = ()  # row indices (0-based in tokens) to sample a token after
    logits_rows: tuple[int, ...] = ()  # row indices whose float32 logits come back (the store keeps them)
    images: tuple[ImageRows, ...] = ()  # embeddings overlapping these rows
    drafts: tuple[int, ...] = ()  # drafted tokens verified by rows 1..k (see above)
    digest_rows: tuple[int, ...] = ()  # row indices whose logits' sha256 comes back
    propose: int = 0  # on a device with a draft head: up to this many drafts after the token sampled here


@dataclass(frozen=True, slots=True)
class Restore:
    """Overwrite the lane's non-page state with a captured `state` (a snapshot or a resident cut)."""

    lane: int
    state: DeviceState


@dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy KV page `src` to page `dst` in every attention layer (copy-on-write of a partial page)."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class SamplerSetup:
    """Bind a fresh sampler to the lane: a generator seeded from `sampling.seed` and the
    repetition history `history`. Touches no KV or recurrent state."""

    lane: int
    sampling: SamplingParams
    history: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StoredSample:
    """Sample the lane's next token from a stored logits row, without a forward (a full hit)."""

    lane: int
    logits: DeviceRows
    row: int = 0
    digest: bool = False  # True: the row's sha256 comes back too


@dataclass(frozen=True, slots=True)
class Capture:
    """Copy the lane's non-page state after the forward; `cut` is the row count it holds."""

    lane: int
    cut: int


@dataclass(frozen=True, slots=True)
class PageExport:
    """Host copies of `pages` (every attention layer, K and V, page-major), of `state` and of
    `logits` for the disk tier's writer (a write-through of a kept entry)."""

    pages: tuple[int, ...]
    state: DeviceState | None = None
    logits: DeviceRows | None = None


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """Everything the device does in one round, run in this fixed order:

        loads -> exports -> resets -> restores -> page copies -> sampler set-up
          -> stored samples -> forward (lanes) -> samples and verify rollbacks -> captures

    Each step runs its items in the order listed. A lane appears at most once in `lanes`,
    `resets`/`restores` (one of them), `stored` and `captures`. A rejected verify rolls its
    lane back inside the round (`LaneWork.drafts`), and the copy may still be in flight when
    the round returns: resets, restores and captures, this round's or a later one's, wait
    for every such copy before they touch the lane's state. Loads write pages nothing has
    read since they were taken; exports read pages before anything in the round writes one.
    """

    lanes: tuple[LaneWork, ...] = ()
    loads: tuple[DiskLoad, ...] = ()
    exports: tuple[PageExport, ...] = ()
    resets: tuple[int, ...] = ()
    restores: tuple[Restore, ...] = ()
    page_copies: tuple[PageCopy, ...] = ()
    samplers: tuple[SamplerSetup, ...] = ()
    stored: tuple[StoredSample, ...] = ()
    captures: tuple[Capture, ...] = ()

    @property
    def num_rows(self) -> int:
        return sum(len(w.tokens) for w in self.lanes)

    @property
    def empty(self) -> bool:
        return not any((self.lanes, self.loads, self.exports, self.resets, self.restores, self.page_copies,
                        self.samplers, self.stored, self.captures))


class DeviceRows(Protocol):
    """Opaque device-side logits rows (gpu/ uses a float32 tensor of shape (n, vocab));
    `rows[i:j]` are rows i..j-1."""

    @property
    def nbytes(self) -> int: ...

    def __getitem__(self, rows: slice) -> "DeviceRows": ...


class DeviceState(Protocol):
    """Opaque per-lane state captured at a cut (recurrent + conv state, draft carry).

    Attention-only families capture an empty state with nbytes == 0.
    """

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class LaneResult:
    """What one `LaneWork` (or one `StoredSample`) gave back."""

    lane: int
    sampled: tuple[int, ...] = ()  # one token per entry of LaneWork.sample_rows (verify: 1..k+1)
    logits: DeviceRows | None = None  # rows for LaneWork.logits_rows, in that order
    logprobs: tuple[TokenLogprob, ...] | None = None  # per sampled token, when its stream asks
    # Set when this lane alone failed (non-finite logits, a sampler error, a bad image): the
    # lane's rows of this round are unusable, `sampled` and `logits` are empty, and every other
    # lane of the round is unaffected.
    error: str | None = None
    digests: tuple[str, ...] = ()  # sha256 hex of each LaneWork.digest_rows row's float32 bytes
    # Draft head (LaneWork.propose): the tokens it proposes after the last token of `sampled`,
    # and the head's probability of the first of them (its confidence).
    proposals: tuple[int, ...] = ()
    proposal_p: float = 0.0


@dataclass(frozen=True, slots=True)
class CapturedState:
    lane: int
    cut: int
    state: DeviceState


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability under the model's fp32 logits row it was drawn
    from (before penalties, filters and grammar), and the `k` most likely (id, logprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RoundResult:
    lanes: tuple[LaneResult, ...]  # one per RoundPlan.lanes entry
    forward_s: float = 0.0  # time spent inside the model forward
    stored: tuple[LaneResult, ...] = ()  # one per RoundPlan.stored entry
    captured: tuple[CapturedState, ...] = ()  # one per RoundPlan.captures entry
    exported: tuple[PagePayload, ...] = ()  # one per RoundPlan.exports entry

    def by_lane(self) -> dict[int, LaneResult]:
        return {r.lane: r for r in self.lanes}


@dataclass(frozen=True, slots=True)
class PagePayload:
    """Host copies for the disk tier: KV pages page-major (each page's bytes together, so a
    file's leading pages are a prefix of its bytes), a lane state and
    a logits row, each a bytes-like buffer (state / logits None when there are none)."""

    kv: Any
    state: Any | None = None
    logits: Any | None = None


@dataclass(frozen=True, slots=True)
class PageLoad:
    """Load `kv` (len(pages) pages' bytes, page-major as `PagePayload.kv`) into `pages`."""

    pages: tuple[int, ...]
    kv: Any


@dataclass(eq=False, slots=True)
class FromDisk:
    """A lane state or logits row that a disk load (`RoundPlan.loads`) makes on the device.

    It stands in the store's snapshot from the moment the entry is fetched; the device sets
    `made` when it runs the load, in the first round after the fetch, before any item of that
    round can use it, and uses `made` wherever a plan names this (a restore, a stored sample,
    an export)."""

    nbytes: int
    made: Any = None


@dataclass(frozen=True, slots=True)
class DiskLoad:
    """What one disk hit puts on the device: page loads, and the snapshot's state and logits
    row as bytes (None when the entry has none), made into `state_to` and `logits_to`."""

    pages: tuple[PageLoad, ...]
    state: Any | None = None
    logits: Any | None = None
    state_to: FromDisk | None = None
    logits_to: FromDisk | None = None


def made(x: Any) -> Any:
    """What the device uses for `x`: a `FromDisk`'s `made`, anything else as it is."""
    if isinstance(x, FromDisk):
        if x.made is None:
            raise RuntimeError("a state or logits row from disk used before its load ran")
        return x.made
    return x
