"""Client requests of protocol v1, one frozen dataclass each.

`from_wire(dict)` checks every field (type and range) and raises
ProtocolError(bad_request, "<field>: why"); `to_wire()` gives the map to send, leaving out
fields that are unset. `parse_request` picks the class by `type`. Server replies and events
live in events.py and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.events import (  # noqa: F401  (re-exported)
    CACHE_RESULTS,
    FINISH_REASONS,
    DoneEvent,
    ErrorReply,
    Event,
    HelloReply,
    OkReply,
    StatusReply,
    TextReply,
    TokenEvent,
    TokensReply,
    Usage,
    parse_event,
)
from prefixd.ipc.fields import MAX_TOKEN_ID, FieldReader, request_id_of
from prefixd.ipc.framing import MemfdRef
from prefixd.ipc.parts import (  # noqa: F401
    MAX_IMAGE_HASH_BYTES,
    Image,
    Sampling,
    drop_none,
    read_chat_message,
    read_response_format,
    read_tool,
    read_tool_choice,
)

PROTOCOL_VERSION = 2  # the newest version this code speaks
SUPPORTED_VERSIONS = (1, 2)
DEFAULT_MAX_TOKENS = 256
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 128  # stop strings in one generate
MAX_CHAT_MESSAGES = 8192  # chat messages in one generate or tokenize, checked before each is read
MAX_STOP_CHARS = 256  # characters in one stop string


class _Request:
    """What every request class shares: `from_wire` checks the type and every field."""

    __slots__ = ()
    TYPE: ClassVar[str]

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Any:
        msg = parse_request(data)
        if not isinstance(msg, cls):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"type: expected {cls.TYPE!r}", request_id_of(data))
        return msg


@dataclass(frozen=True, slots=True)
class Hello(_Request):
    """Version negotiation; optional (a connection without it speaks v1)."""

    TYPE: ClassVar[str] = "hello"
    id: int
    versions: tuple[int, ...] = (PROTOCOL_VERSION,)
    client: str | None = None

    @classmethod
    def read(cls, r: FieldReader) -> Hello:
        versions = r.ints("versions")
        if not versions:
            raise r.error("versions", "must not be empty")
        return cls(r.int("id"), versions, r.str("client", None))

    def to_wire(self) -> dict[str, Any]:
        return drop_none({"type": self.TYPE, "id": self.id, "versions": list(self.versions), "client": self.client})


@dataclass(frozen=True, slots=True)
class Generate(_Request):
    """Generate tokens for exactly one of: a text prompt, token ids, or chat messages."""

    TYPE: ClassVar[str] = "generate"
    id: int
    prompt: str | None = None
    tokens: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    chunk_starts: tuple[int, ...] | None = None  # None: the start of every chat message
    namespace: str = ""
    cache: bool = True
    cache_key: tuple[int, ...] | None = None
    logits: bool = False  # token events carry logits_sha256
    images: tuple[Image, ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None  # v2: OpenAI function tools
    tool_choice: str | dict[str, Any] | None = None  # v2: auto | none | required | a named function
    response_format: dict[str, Any] | None = None  # v2: constrained output (json_object, json_schema, ...)
    logprobs: int | None = None  # v2: token events carry each token's logprob and this many alternatives

    @property
    def min_version(self) -> int:
        """The protocol version that has every field this request sets."""
        return 2 if self.v2_field is not None else 1

    @property
    def v2_field(self) -> str | None:
        """The first field set that protocol version 1 lacks."""
        for name in ("tools", "tool_choice", "response_format", "logprobs"):
            if getattr(self, name) is not None:
                return name
        return None

    @classmethod
    def read(cls, r: FieldReader) -> Generate:
        given = [name for name in ("prompt", "tokens", "messages") if r.has(name)]
        if len(given) != 1:
            raise r.error("prompt", f"exactly one of prompt, tokens, messages is required, got {len(given)}")
        messages = _chat_messages(r)
        if messages is not None and not messages:
            raise r.error("messages", "must not be empty")
        msg = cls(
            id=r.int("id"),
            prompt=r.str("prompt", None),
            tokens=r.ints("tokens", None, hi=MAX_TOKEN_ID, code=ErrorCode.INVALID_TOKEN),
            messages=messages,
            max_tokens=r.int("max_tokens", DEFAULT_MAX_TOKENS, lo=1, hi=(1 << 31) - 1),
            sampling=Sampling.read(r.nested("sampling", r.map("sampling", {}))),
            stop=r.strs("stop", ()),
            stop_ids=r.ints("stop_ids", (), hi=MAX_TOKEN_ID, code=ErrorCode.INVALID_TOKEN),
            chunk_starts=r.ints("chunk_starts", None),
            namespace=r.str("namespace", ""),
            cache=r.bool("cache", True),
            cache_key=r.ints("cache_key", None),
            logits=r.bool("logits", False),
            images=r.each("images", r.list("images", []), Image.read),
            tools=r.each("tools", r.list("tools"), read_tool) if r.has("tools") else r.list("tools", None),
            tool_choice=read_tool_choice(r, "tool_choice"),
            response_format=read_response_format(r, "response_format"),
            logprobs=r.int("logprobs", None, hi=MAX_TOP_LOGPROBS),
        )
        _check_generate(msg, r)
        return msg

    def to_wire(self) -> dict[str, Any]:
        return drop_none({
            "type": self.TYPE,
            "id": self.id,
            "prompt": self.prompt,
            "tokens": None if self.tokens is None else list(self.tokens),
            "messages": None if self.messages is None else [dict(m) for m in self.messages],
            "max_tokens": self.max_tokens,
            "sampling": self.sampling.to_wire(),
            "stop": list(self.stop) or None,
            "stop_ids": list(self.stop_ids) or None,
            "chunk_starts": None if self.chunk_starts is None else list(self.chunk_starts),
            "namespace": self.namespace or None,
            "cache": self.cache,
            "cache_key": None if self.cache_key is None else list(self.cache_key),
            "logits": self.logits,
            "images": [image.to_wire() for image in self.images] or None,
            "tools": None if self.tools is None else [dict(t) for t in self.tools],
            "tool_choice": self.tool_choice,
            "response_format": self.response_format,
            "logprobs": self.logprobs,
        })


def _chat_messages(r: FieldReader) -> tuple[dict[str, Any], ...] | None:
    messages = r.list("messages", None)
    if messages is None:
        return None
    if len(messages) > MAX_CHAT_MESSAGES:
        raise r.error("messages", f"{len(messages)} messages; a conversation may hold at most {MAX_CHAT_MESSAGES}")
    return r.each("messages", messages, read_chat_message)


def _check_generate(msg: Generate, r: FieldReader) -> None:
    if msg.tokens is not None and not msg.tokens:
        raise r.error("tokens", "must not be empty")
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise r.error("stop", f"{len(msg.stop)} stop strings; at most {MAX_STOP_STRINGS}")
    if any(not s for s in msg.stop):
        raise r.error("stop", "stop strings must not be empty")
    longest = max((len(s) for s in msg.stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise r.error("stop", f"a stop string of {longest} characters; at most {MAX_STOP_CHARS} each")
    starts = msg.chunk_starts or ()
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise r.error("chunk_starts", "must be strictly increasing")
    for i, (a, b) in enumerate(zip(msg.images, msg.images[1:])):
        if b.at < a.at + a.tokens:
            raise r.error(f"images[{i + 1}].at", "images must be sorted and must not overlap")
    if (msg.tools is not None or msg.tool_choice is not None) and msg.messages is None:
        raise r.error("tools", "tools and tool_choice need messages")
    names = [t["function"]["name"] for t in msg.tools or ()]
    if isinstance(msg.tool_choice, dict) and msg.tool_choice["function"]["name"] not in names:
        raise r.error("tool_choice", f"names {msg.tool_choice['function']['name']!r}, which is not in tools")


@dataclass(frozen=True, slots=True)
class Cancel(_Request):
    """End the in-flight generate `target`; answered by ok, then target's done(cancelled)."""

    TYPE: ClassVar[str] = "cancel"
    id: int
    target: int

    @classmethod
    def read(cls, r: FieldReader) -> Cancel:
        return cls(r.int("id"), r.int("target"))

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "target": self.target}


@dataclass(frozen=True, slots=True)
class Status(_Request):
    """Ask for the daemon's status map."""

    TYPE: ClassVar[str] = "status"
    id: int

    @classmethod
    def read(cls, r: FieldReader) -> Status:
        return cls(r.int("id"))

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id}


@dataclass(frozen=True, slots=True)
class Tokenize(_Request):
    """Token ids of a text or of chat messages rendered with the model's template."""

    TYPE: ClassVar[str] = "tokenize"
    id: int
    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    add_special: bool | None = None  # None: the tokenizer's default

    @classmethod
    def read(cls, r: FieldReader) -> Tokenize:
        if r.has("text") == r.has("messages"):
            raise r.error("text", "exactly one of text, messages is required")
        messages = _chat_messages(r)
        return cls(r.int("id"), r.str("text", None), messages, r.bool("add_special", None))

    def to_wire(self) -> dict[str, Any]:
        return drop_none({
            "type": self.TYPE,
            "id": self.id,
            "text": self.text,
            "messages": None if self.messages is None else [dict(m) for m in self.messages],
            "add_special": self.add_special,
        })


@dataclass(frozen=True, slots=True)
class Detokenize(_Request):
    """The text of token ids."""

    TYPE: ClassVar[str] = "detokenize"
    id: int
    ids: tuple[int, ...]

    @classmethod
    def read(cls, r: FieldReader) -> Detokenize:
        return cls(r.int("id"), r.ints("ids", hi=MAX_TOKEN_ID, code=ErrorCode.INVALID_TOKEN))

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "ids": list(self.ids)}


Request = Union[Hello, Generate, Cancel, Status, Tokenize, Detokenize]
REQUEST_TYPES: dict[str, Any] = {cls.TYPE: cls for cls in (Hello, Generate, Cancel, Status, Tokenize, Detokenize)}


def parse_request(data: dict[str, Any], version: int = PROTOCOL_VERSION) -> Request:
    """The request a client sent on a connection speaking `version`. Raises ProtocolError
    carrying the request's id when the id itself is valid: unknown_type for an unknown
    `type`, bad_request for bad fields (and for fields newer than `version`)."""
    request_id = request_id_of(data)
    kind = data.get("type") if type(data) is dict else None
    if type(kind) is not str:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "type: required string", request_id)
    cls = REQUEST_TYPES.get(kind)
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"type: unknown message type {kind!r}", request_id)
    r = FieldReader(data, request_id=request_id)
    r.str("type")
    msg = cls.read(r)
    r.finish()
    needed = getattr(msg, "min_version", 1)
    if needed > version:
        raise r.error(msg.v2_field, f"needs protocol version {needed}; this connection speaks {version} "
                                  f"(send hello with versions [{needed}])")
    return msg


_IMAGE_FIELDS = frozenset({"at", "tokens", "gh", "gw", "hash", "rows"})


def check_before_payloads(data: dict[str, Any], max_prompt_tokens: int | None) -> None:
    """Refuse a request on what it holds without its memfd payloads, before any is read.

    Checks the type, unknown fields (top level and images[]), and a `tokens` segment whose
    size alone says the prompt is longer than `max_prompt_tokens` (context_overflow).
    Raises ProtocolError with the request's id when that id is valid.
    """
    request_id = request_id_of(data)
    kind = data.get("type")
    cls = REQUEST_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        parse_request(data)  # raises the error a request of no known type gets
        return
    known = {"type"} | {f for f in cls.__dataclass_fields__ if f != "TYPE"}
    _refuse_unknown(data, known, "", request_id)
    images = data.get("images")
    if cls is Generate and type(images) is list:
        for i, image in enumerate(images):
            if type(image) is dict:
                _refuse_unknown(image, _IMAGE_FIELDS, f"images[{i}].", request_id)
    tokens = data.get("tokens")
    if cls is Generate and isinstance(tokens, MemfdRef) and max_prompt_tokens is not None:
        num_tokens = tokens.num_bytes // tokens.dtype.itemsize
        if num_tokens > max_prompt_tokens:
            raise ProtocolError(ErrorCode.CONTEXT_OVERFLOW,
                                f"tokens: {num_tokens} tokens exceed the context of {max_prompt_tokens}", request_id)


def _refuse_unknown(data: dict[str, Any], known: set[str] | frozenset[str], where: str, request_id: int | None) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}{unknown[0]}: unknown field", request_id)
