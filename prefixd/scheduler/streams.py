"""Stream requests, their validation, the events the engine emits, and a stream's live state."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixd.ipc.events import Usage  # the one Usage: the engine fills it, the wire carries it
from prefixd.scheduler.chunks import Schedule
from prefixd.scheduler.records import CacheResult, FinishReason, ImageRows, SamplingParams, TokenLogprob


class RequestError(Exception):
    """Bad client input; becomes `{code, message}` on the wire.

    Codes: "invalid_token", "context_overflow", "bad_request".
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """One generation request.

    A sampled id in `stop_ids` ends the stream ("stop") and is the last id emitted.
    `chunk_starts` ascend inside [0, n); a start at 0 (a first message) is implied and dropped.
    `cache_key`, when given, replaces `tokens` as the reuse identity.
    `client` names who sent it (the front's identity of the peer: its process on the socket,
    its address or namespace over HTTP; "" unknown, one client for all): seating and the
    round's rows go first to the client served least lately (docs/store.md, *Round policy*).
    """

    stream_id: int
    tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()
    chunk_starts: tuple[int, ...] = ()
    namespace: str = ""
    cache: bool = True
    cache_key: tuple[int, ...] | None = None
    images: tuple[ImageRows, ...] = ()
    want_logits: bool = False
    draft: bool = True  # False: this stream never drafts (the request's `draft: "off"`)
    client: str = ""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens sampled for a stream this round; when asked for, the sha256 hex of the float32
    logits row each id was sampled from (computed by the device, where the rows are)."""

    stream_id: int
    ids: tuple[int, ...]
    logits_sha256: tuple[str, ...] | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # per id, when the stream asks


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """A stream ended."""

    stream_id: int
    finish_reason: FinishReason
    usage: Usage
    note: str | None = None


def validate_request(req: StreamRequest, *, vocab_size: int, max_context: int, pool_rows: int | None = None) -> None:
    """Raise RequestError if `req` cannot be served as sent (`pool_rows`: rows the KV pool holds)."""
    n = len(req.tokens)
    if n == 0:
        raise RequestError("bad_request", "the prompt is empty")
    if n > max_context - 1:
        raise RequestError(
            "context_overflow",
            f"the prompt has {n} tokens; the context holds {max_context}, so at most {max_context - 1} fit",
        )
    if pool_rows is not None and n > pool_rows:
        raise RequestError("context_overflow", f"the prompt has {n} tokens; the KV pool holds {pool_rows} rows")
    for t in req.tokens:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise RequestError("invalid_token", f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
    if req.max_tokens <= 0:
        raise RequestError("bad_request", f"max_tokens must be positive, got {req.max_tokens}")
    problem = req.sampling.problem()
    if problem is not None:  # checked here too, so no front can hand a lane a sampler that fails
        raise RequestError("bad_request", problem)
    prev = -1
    for s in req.chunk_starts:
        if not prev < s < n:
            raise RequestError("bad_request", f"chunk_starts must be increasing and inside [0, {n}), got {list(req.chunk_starts)}")
        prev = s
    end = 0
    for ident in sorted((im.identity for im in req.images), key=lambda i: i.at):
        if ident.tokens <= 0 or ident.at < end or ident.at + ident.tokens > n:
            raise RequestError("bad_request", f"image rows [{ident.at}, {ident.at + ident.tokens}) overlap another image or leave the prompt")
        end = ident.at + ident.tokens


def context_full_note(stream: Stream, max_context: int) -> str:
    """The done note of a stream the context ended before its max_tokens (clamped, not refused)."""
    return (f"stopped at the context: {stream.num_prompt} prompt + {len(stream.generated)} generated tokens "
            f"fill max_context {max_context} before max_tokens {stream.req.max_tokens}")


@dataclass(eq=False)
class Stream:
    """A stream's live state inside the engine (mutable; engine-private)."""

    req: StreamRequest
    submit_s: float
    seq: int  # admission order
    schedule: Schedule  # the prompt's prefill schedule (chunks and cuts)
    lane: int | None = None
    admit_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    chunks: list[tuple[int, int]] = field(default_factory=list)
    next_chunk: int = 0
    generated: list[int] = field(default_factory=list)
    cache_result: CacheResult = "off"
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    cancelled: bool = False
    keep_rows: int | None = None  # on cancel: rows its lane keeps when left resident
    note: str | None = None
    key: object | None = None  # store.ReuseKey of the prompt; None: may not reuse or keep
    hit: object | None = None  # a pinned store.Hit (pages held) found while waiting
    looked_up: bool = False
    hit_shared: bool = False  # `hit` resumes from an entry the shared tier sent for this lookup
    diagnosis: object | None = None  # diagnosis.Diagnosis: why the cache gave no more (usage only)
    drafter: object | None = None  # drafting.StreamDrafter while the stream drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def stream_id(self) -> int:
        return self.req.stream_id

    @property
    def num_prompt(self) -> int:
        return len(self.req.tokens)

    @property
    def prefilling(self) -> bool:
        return self.next_chunk < len(self.chunks)

    def advance(self, end: int) -> None:
        """Rows up to `end` are prefilled: chunks below it are done; a chunk `end` lies inside
        keeps its end and now starts at `end` (its boundaries stay the schedule's)."""
        while self.next_chunk < len(self.chunks) and self.chunks[self.next_chunk][1] <= end:
            self.next_chunk += 1
        if self.next_chunk < len(self.chunks) and self.chunks[self.next_chunk][0] < end:
            self.chunks[self.next_chunk] = (end, self.chunks[self.next_chunk][1])

    @property
    def decoding(self) -> bool:
        """Seated, prefilled and holding a sampled token to feed (a full hit has none until its
        stored-row sample comes back)."""
        return self.lane is not None and not self.prefilling and bool(self.generated)

    @property
    def key_tokens(self) -> tuple[int, ...]:
        """The prompt's reuse identity tokens (the prompt's own when the key does not line up)."""
        key = self.req.cache_key
        return key if key is not None and len(key) == len(self.req.tokens) else self.req.tokens

    def usage(self, now_s: float) -> Usage:
        ttft = (self.first_token_s - self.submit_s) if self.first_token_s is not None else 0.0
        return Usage(
            prompt_tokens=self.num_prompt,
            cached_tokens=self.cached_tokens,
            prefilled_tokens=self.prefilled_tokens,
            completion_tokens=len(self.generated),
            cache=self.cache_result,
            ttft_s=ttft,
            total_s=now_s - self.submit_s,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            cache_reason=getattr(self.diagnosis, "reason", None),
            divergence=getattr(self.diagnosis, "divergence", None),
        )
