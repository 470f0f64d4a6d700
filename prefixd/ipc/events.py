"""Server replies and events of protocol v1, one frozen dataclass each.

Clients read them with `parse_event`, which checks the fields it knows and ignores fields
it does not (a server may add optional fields within a version).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.fields import MAX_TOKEN_ID, FieldReader

FINISH_REASONS = ("stop", "length", "cancelled", "error", "tool_calls")  # tool_calls: v2
CACHE_RESULTS = ("miss", "hit", "shared", "resident", "off")
SHA256_HEX_CHARS = 64


class _Event:
    """What every event class shares: `from_wire` checks the type and the known fields."""

    __slots__ = ()
    TYPE: ClassVar[str]

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Any:
        event = parse_event(data)
        if not isinstance(event, cls):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"type: expected {cls.TYPE!r}")
        return event


@dataclass(frozen=True, slots=True)
class HelloReply(_Event):
    """The version the server speaks on this connection, what it runs and its limits."""

    TYPE: ClassVar[str] = "hello"
    id: int
    version: int
    server: str
    model: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, r: FieldReader) -> HelloReply:
        return cls(r.int("id"), r.int("version"), r.str("server"), r.map("model", {}), r.map("limits", {}))

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE, "id": self.id, "version": self.version,
            "server": self.server, "model": self.model, "limits": self.limits,
        }


@dataclass(frozen=True, slots=True)
class TokenEvent(_Event):
    """Tokens one round produced for generate `id`, and the text they complete.

    `text` holds only whole UTF-8 characters; bytes of a character split across tokens
    arrive with the token that completes it.
    """

    TYPE: ClassVar[str] = "token"
    id: int
    ids: tuple[int, ...]
    text: str
    logits_sha256: tuple[str, ...] | None = None  # per id: sha256 hex of its float32 logits row
    # v2, per id: {id, logprob, top: [{id, logprob}, ...]} from the fp32 row it was drawn from
    logprobs: tuple[dict[str, Any], ...] | None = None

    @classmethod
    def read(cls, r: FieldReader) -> TokenEvent:
        logprobs = r.list("logprobs", None)
        event = cls(r.int("id"), r.ints("ids", hi=MAX_TOKEN_ID), r.str("text"), r.strs("logits_sha256", None),
                    None if logprobs is None else r.each("logprobs", logprobs, _read_logprob))
        digests = event.logits_sha256
        if digests is not None:
            if len(digests) != len(event.ids):
                raise r.error("logits_sha256", f"{len(digests)} digests for {len(event.ids)} ids")
            if any(len(d) != SHA256_HEX_CHARS for d in digests):
                raise r.error("logits_sha256", "digests are 64 hex characters")
        return event

    def to_wire(self) -> dict[str, Any]:
        out = {"type": self.TYPE, "id": self.id, "ids": list(self.ids), "text": self.text}
        if self.logits_sha256 is not None:
            out["logits_sha256"] = list(self.logits_sha256)
        if self.logprobs is not None:
            out["logprobs"] = [dict(entry) for entry in self.logprobs]
        return out


def _read_logprob(r: FieldReader) -> dict[str, Any]:
    top = r.list("top", [])
    return {"id": r.int("id", hi=MAX_TOKEN_ID), "logprob": r.float("logprob"),
            "top": [{"id": t.int("id", hi=MAX_TOKEN_ID), "logprob": t.float("logprob")}
                    for t in (r.nested(f"top[{i}]", item) for i, item in enumerate(top))]}


# Why a generate's prompt was not served (further) from the cache: `usage.cache_reason`, and the
# `reason` label of prefixd_prefix_cache_misses_total. docs/protocol.md, *generate*, says each.
CACHE_REASONS = ("cache_off", "namespace_empty", "evicted", "other_schedule", "too_short", "diverged")
EXCERPT_KEYS = ("before", "new_token", "new_rest", "cached_token", "cached_rest")


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a prompt parts from the longest cached prefix of its namespace.

    Rows [0, at) of the prompt are identity-equal to rows the cache holds; row `at` is not.
    `cached_id` is None where the cached rows end at `at`. The ids around it are a few on each
    side (the engine's); `excerpt` is their text, filled by the front that has the tokenizer:
    before, new_token + new_rest (the prompt from `at`), cached_token + cached_rest.
    """

    at: int
    new_id: int
    cached_id: int | None = None
    before_ids: tuple[int, ...] = ()  # prompt ids just before `at`
    new_ids: tuple[int, ...] = ()  # prompt ids from `at`
    cached_ids: tuple[int, ...] = ()  # cached ids from `at`
    excerpt: dict[str, str] | None = None

    @classmethod
    def read(cls, r: FieldReader) -> Divergence:
        excerpt = r.map("excerpt", None)
        if excerpt is not None:
            ex = r.nested("excerpt", excerpt)
            excerpt = {k: ex.str(k, "") for k in EXCERPT_KEYS}
        return cls(r.int("at"), r.int("new_id", hi=MAX_TOKEN_ID), r.int("cached_id", None, hi=MAX_TOKEN_ID),
                   r.ints("before_ids", (), hi=MAX_TOKEN_ID), r.ints("new_ids", (), hi=MAX_TOKEN_ID),
                   r.ints("cached_ids", (), hi=MAX_TOKEN_ID), excerpt)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"at": self.at, "new_id": self.new_id, "before_ids": list(self.before_ids),
                               "new_ids": list(self.new_ids), "cached_ids": list(self.cached_ids)}
        if self.cached_id is not None:
            out["cached_id"] = self.cached_id
        if self.excerpt is not None:
            out["excerpt"] = dict(self.excerpt)
        return out


@dataclass(frozen=True, slots=True)
class Usage:
    """What a generate cost: tokens by kind, times in seconds, and what the cache gave."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the cache or a resident lane
    prefilled_tokens: int = 0  # prompt tokens computed by this request
    completion_tokens: int = 0
    ttft_s: float = 0.0  # from receipt of the request to its first token
    total_s: float = 0.0
    cache: str = "miss"  # miss | hit | shared | resident | off
    draft_tokens: int = 0  # drafted tokens verified
    accepted_tokens: int = 0  # of them, accepted
    cache_reason: str | None = None  # why nothing (or not more) was reused; None: not known
    divergence: Divergence | None = None  # where the prompt left the cache; None: not known

    @classmethod
    def read(cls, r: FieldReader) -> Usage:
        divergence = r.map("divergence", None)
        return cls(
            prompt_tokens=r.int("prompt_tokens"),
            cached_tokens=r.int("cached_tokens"),
            prefilled_tokens=r.int("prefilled_tokens"),
            completion_tokens=r.int("completion_tokens"),
            ttft_s=r.float("ttft_s", lo=0.0),
            total_s=r.float("total_s", lo=0.0),
            cache=r.str("cache", choices=CACHE_RESULTS),
            draft_tokens=r.int("draft_tokens", 0),
            accepted_tokens=r.int("accepted_tokens", 0),
            cache_reason=r.str("cache_reason", None),
            divergence=None if divergence is None else Divergence.read(r.nested("divergence", divergence)),
        )

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Usage:
        return cls.read(FieldReader(data, "usage.", strict=False))

    def to_wire(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "prefilled_tokens": self.prefilled_tokens, "completion_tokens": self.completion_tokens,
            "ttft_s": self.ttft_s, "total_s": self.total_s, "cache": self.cache,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            **({} if self.cache_reason is None else {"cache_reason": self.cache_reason}),
            **({} if self.divergence is None else {"divergence": self.divergence.to_wire()}),
        }


@dataclass(frozen=True, slots=True)
class DoneEvent(_Event):
    """The last event of a generate."""

    TYPE: ClassVar[str] = "done"
    id: int
    finish_reason: str  # stop | length | cancelled | error
    usage: Usage = field(default_factory=Usage)
    note: str | None = None  # e.g. why a cache key was not used, or what the error was
    # v2: the calls the reply made, each {id, type: "function", function: {name, arguments: JSON text}}
    tool_calls: tuple[dict[str, Any], ...] | None = None

    @classmethod
    def read(cls, r: FieldReader) -> DoneEvent:
        calls = r.list("tool_calls", None)
        return cls(
            r.int("id"),
            r.str("finish_reason", choices=FINISH_REASONS),
            Usage.read(r.nested("usage", r.map("usage"))),
            r.str("note", None),
            None if calls is None else r.each("tool_calls", calls, _read_tool_call),
        )

    def to_wire(self) -> dict[str, Any]:
        out = {"type": self.TYPE, "id": self.id, "finish_reason": self.finish_reason, "usage": self.usage.to_wire()}
        if self.note is not None:
            out["note"] = self.note
        if self.tool_calls is not None:
            out["tool_calls"] = [dict(call) for call in self.tool_calls]
        return out


def _read_tool_call(r: FieldReader) -> dict[str, Any]:
    function = r.nested("function", r.map("function"))
    return {"id": r.str("id"), "type": r.str("type", "function"),
            "function": {"name": function.str("name"), "arguments": function.str("arguments")}}


@dataclass(frozen=True, slots=True)
class OkReply(_Event):
    """A request that needs no answer beyond success (cancel)."""

    TYPE: ClassVar[str] = "ok"
    id: int

    @classmethod
    def read(cls, r: FieldReader) -> OkReply:
        return cls(r.int("id"))

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id}


@dataclass(frozen=True, slots=True)
class StatusReply(_Event):
    """The daemon's status: a free-form map (lanes, cache, model, ...)."""

    TYPE: ClassVar[str] = "status"
    id: int
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, r: FieldReader) -> StatusReply:
        request_id = r.int("id")
        r.str("type")
        return cls(request_id, r.rest())

    def to_wire(self) -> dict[str, Any]:
        return {**self.info, "type": self.TYPE, "id": self.id}


@dataclass(frozen=True, slots=True)
class TokensReply(_Event):
    """Token ids of a tokenize request; message_starts when it tokenized chat messages."""

    TYPE: ClassVar[str] = "tokens"
    id: int
    ids: tuple[int, ...]
    message_starts: tuple[int, ...] | None = None

    @classmethod
    def read(cls, r: FieldReader) -> TokensReply:
        return cls(r.int("id"), r.ints("ids", hi=MAX_TOKEN_ID), r.ints("message_starts", None))

    def to_wire(self) -> dict[str, Any]:
        out = {"type": self.TYPE, "id": self.id, "ids": list(self.ids)}
        if self.message_starts is not None:
            out["message_starts"] = list(self.message_starts)
        return out


@dataclass(frozen=True, slots=True)
class TextReply(_Event):
    """The text of a detokenize request."""

    TYPE: ClassVar[str] = "text"
    id: int
    text: str

    @classmethod
    def read(cls, r: FieldReader) -> TextReply:
        return cls(r.int("id"), r.str("text"))

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "text": self.text}


@dataclass(frozen=True, slots=True)
class ErrorReply(_Event):
    """A request failed (id set) or the connection is in error (id None)."""

    TYPE: ClassVar[str] = "error"
    id: int | None
    code: str
    message: str

    @classmethod
    def read(cls, r: FieldReader) -> ErrorReply:
        return cls(r.int("id", None), r.str("code"), r.str("message"))

    @classmethod
    def of(cls, error: ProtocolError) -> ErrorReply:
        return cls(error.request_id, error.code.value, error.message)

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "code": self.code, "message": self.message}


Event = Union[HelloReply, TokenEvent, DoneEvent, OkReply, StatusReply, TokensReply, TextReply, ErrorReply]
EVENT_TYPES: dict[str, Any] = {
    cls.TYPE: cls for cls in (HelloReply, TokenEvent, DoneEvent, OkReply, StatusReply, TokensReply, TextReply, ErrorReply)
}


def parse_event(data: dict[str, Any]) -> Event:
    """The event a server sent. Raises ProtocolError(bad_request | unknown_type)."""
    kind = data.get("type") if type(data) is dict else None
    cls = EVENT_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"type: unknown event type {kind!r}")
    return cls.read(FieldReader(data, strict=False))
