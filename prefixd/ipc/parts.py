"""The maps inside a generate request: sampling, images, chat messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixd.ipc.fields import FieldReader

MAX_IMAGE_HASH_BYTES = 64
_REQUIRED: Any = FieldReader.REQUIRED


def drop_none(data: dict[str, Any]) -> dict[str, Any]:
    """`data` without its nil values: unset optional fields are left off the wire."""
    return {k: v for k, v in data.items() if v is not None}


class _Nested:
    """A map inside a request; `from_wire` checks it alone."""

    __slots__ = ()

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Any:
        return cls.read(FieldReader(data))  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Sampling(_Nested):
    """How tokens are picked; the defaults are greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    seed: int | None = None  # None: the daemon draws one

    @classmethod
    def read(cls, r: FieldReader) -> Sampling:
        out = cls(
            temperature=r.float("temperature", 0.0, lo=0.0),
            top_k=r.int("top_k", 0, hi=(1 << 31) - 1),
            top_p=r.float("top_p", 1.0, lo=0.0, hi=1.0),
            min_p=r.float("min_p", 0.0, lo=0.0, hi=1.0),
            repetition_penalty=r.float("repetition_penalty", 1.0, lo=0.0),
            seed=r.int("seed", None, hi=(1 << 64) - 1),
        )
        if out.top_p == 0.0:
            raise r.error("top_p", "must be above 0")
        if out.repetition_penalty == 0.0:
            raise r.error("repetition_penalty", "must be above 0")
        r.finish()
        return out

    def to_wire(self) -> dict[str, Any]:
        return drop_none({
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
        })


@dataclass(frozen=True, slots=True)
class Image(_Nested):
    """An image embedding placed over prompt rows [at, at + tokens).

    `rows` holds tokens x hidden float32 values, little-endian, row-major (bytes as received,
    any bytes-like when built locally); the daemon checks hidden against the model.
    """

    at: int
    tokens: int
    gh: int
    gw: int
    hash: bytes
    rows: Any

    @classmethod
    def read(cls, r: FieldReader) -> Image:
        image = cls(
            at=r.int("at"),
            tokens=r.int("tokens", lo=1),
            gh=r.int("gh", lo=1),
            gw=r.int("gw", lo=1),
            hash=bytes(r.bytes("hash")),
            rows=r.bytes("rows"),
        )
        if not 0 < len(image.hash) <= MAX_IMAGE_HASH_BYTES:
            raise r.error("hash", f"must hold 1 to {MAX_IMAGE_HASH_BYTES} bytes")
        num_bytes = memoryview(image.rows).nbytes
        if num_bytes == 0 or num_bytes % (image.tokens * 4):
            raise r.error("rows", f"{num_bytes} bytes is not tokens x hidden float32 values")
        r.finish()
        return image

    @property
    def hidden(self) -> int:
        return memoryview(self.rows).nbytes // (self.tokens * 4)

    def to_wire(self) -> dict[str, Any]:
        return {"at": self.at, "tokens": self.tokens, "gh": self.gh, "gw": self.gw, "hash": self.hash, "rows": self.rows}


def read_chat_message(r: FieldReader) -> dict[str, Any]:
    """One chat message: role and content strings, plus any template fields kept as sent.
    An assistant message carrying `tool_calls` may leave its content out."""
    calls = r.list("tool_calls", None)
    message = {"role": r.str("role"), "content": r.str("content", "" if calls else _REQUIRED)}
    if calls is not None:
        message["tool_calls"] = list(r.each("tool_calls", calls, _read_tool_call))
    message.update(r.rest())
    return message


def _read_tool_call(r: FieldReader) -> dict[str, Any]:
    call_id = r.str("id", None)
    r.str("type", "function", choices=("function",))
    function = r.nested("function", r.map("function"))
    name = function.str("name")
    raw = function.data.get("arguments")
    arguments = function.str("arguments") if isinstance(raw, str) else function.map("arguments", {})
    function.finish()
    r.finish()
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        out["id"] = call_id
    return out


def read_tool(r: FieldReader) -> dict[str, Any]:
    """One OpenAI function tool: {type: "function", function: {name, description?, parameters?}}."""
    r.str("type", choices=("function",))
    function = r.nested("function", r.map("function"))
    out: dict[str, Any] = {"name": function.str("name")}
    if not out["name"]:
        raise function.error("name", "must not be empty")
    for key, value in (("description", function.str("description", None)),
                       ("parameters", function.map("parameters", None)),
                       ("strict", function.bool("strict", None))):
        if value is not None:
            out[key] = value
    function.finish()
    r.finish()
    return {"type": "function", "function": out}


TOOL_CHOICES = ("auto", "none", "required")


def read_tool_choice(r: FieldReader, name: str) -> str | dict[str, Any] | None:
    """`auto`, `none`, `required`, or {type: "function", function: {name}} (a named function)."""
    value = r.data.get(name)
    if value is None or isinstance(value, str):
        return r.str(name, None, choices=TOOL_CHOICES)
    named = r.nested(name, r.map(name))
    named.str("type", choices=("function",))
    function = named.nested("function", named.map("function"))
    out = {"type": "function", "function": {"name": function.str("name")}}
    function.finish()
    named.finish()
    return out


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")


def read_response_format(r: FieldReader, name: str) -> dict[str, Any] | None:
    """{type: text | json_object} | {type: json_schema, json_schema: {name?, schema (map or
    JSON text), strict?, description?}} | {type: regex, regex} | {type: grammar, grammar (Lark)}."""
    value = r.map(name, None)
    if value is None:
        return None
    f = r.nested(name, value)
    kind = f.str("type", choices=RESPONSE_FORMATS)
    out: dict[str, Any] = {"type": kind}
    if kind == "json_schema":
        spec = f.nested("json_schema", f.map("json_schema"))
        schema = spec.data.get("schema")
        out["json_schema"] = {
            "name": spec.str("name", "response"),
            "schema": spec.str("schema") if isinstance(schema, str) else spec.map("schema", {}),
            "strict": spec.bool("strict", None),
            "description": spec.str("description", None),
        }
        out["json_schema"] = drop_none(out["json_schema"])
        spec.finish()
    elif kind in ("regex", "grammar"):
        out[kind] = f.str(kind)
    f.finish()
    return out
