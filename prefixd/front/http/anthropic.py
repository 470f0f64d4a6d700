"""Anthropic's Messages API on the HTTP front: POST /v1/messages, /v1/messages/count_tokens.

A Messages request becomes the chat completions generate that says the same
(anthropic_map.py) and then goes the chat route's way, through the same calls:
HttpFront._start (pacing, heavy-work slots, a fair seat, the in-flight cap) -> the engine ->
HttpFront._events (the OutputProcessor: stop strings, tool calls). This module spells the
events as a Message, or as Anthropic's server-sent events:

    message_start, ping
    content_block_start (thinking) · content_block_delta (thinking_delta)* · (signature_delta)
        · content_block_stop                                  when the reply thinks
    content_block_start (text) · content_block_delta (text_delta)* · content_block_stop
    per tool call: content_block_start (tool_use) · content_block_delta (input_json_delta) · content_block_stop
    message_delta (stop_reason, stop_sequence, usage) · message_stop

Usage keeps Anthropic's sum: input_tokens + cache_read_input_tokens +
cache_creation_input_tokens is the prompt. cache_read_input_tokens is what the cache or a
resident lane gave (the socket front's cached_tokens), input_tokens the rest, and
cache_creation_input_tokens is always 0: prefixd keeps prefixes as it computes them, with
no separate write to count or bill. message_start counts the whole prompt as input (what the
cache gives is known when the stream ends); message_delta carries the final split.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from prefixd.front.http.anthropic_map import MessagesRequest, map_messages, user_id
from prefixd.front.http.app import NAMESPACE_HEADER, read_mapped
from prefixd.front.http.extension import UsageExtension
from prefixd.front.http.openai_map import HttpError
from prefixd.front.output import reasoning_of
from prefixd.ipc.events import DoneEvent, TokenEvent

if TYPE_CHECKING:
    from prefixd.front.http.app import HttpFront

# Anthropic's error types by the HTTP status the chat front answers.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(e: HttpError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def sse(name: str, body: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class MessagesApi:
    """The two routes over one HttpFront (whose `normalisers` are the prompt hygiene applied,
    prefixd/text/hygiene.py)."""

    def __init__(self, front: HttpFront) -> None:
        self.front = front

    async def messages(self, request: Request) -> Response:
        return await self._guard(request, lambda: self._messages(request))

    async def count_tokens(self, request: Request) -> Response:
        return await self._guard(request, lambda: self._count_tokens(request))

    async def _guard(self, request: Request, handler: Any) -> Response:
        try:
            self.front._authorize(request)
            return await handler()
        except HttpError as e:
            await self.front.charge_refusal(request, e)
            return JSONResponse(error_body(e), status_code=e.status)

    async def _mapped(self, request: Request, *, counting: bool) -> tuple[MessagesRequest, str]:
        reasoning = self._template_reasons()

        def parse(body: dict[str, Any]) -> tuple[MessagesRequest, str]:
            self.front.check_model(body.get("model"))
            namespace = request.headers.get(NAMESPACE_HEADER) or user_id(body)
            return map_messages(body, namespace, reasoning=reasoning, normalisers=self.front.normalisers,
                                counting=counting), namespace

        return await read_mapped(request, parse)

    def _template_reasons(self) -> bool:
        """Whether a chat template of the model renders `reasoning_content` (where thinking
        blocks go; the same answer every turn, so a conversation's prefix stays put)."""
        tokenizer = self.front.services.builder.tokenizer
        sources = [getattr(tokenizer, "chat_template", None), *getattr(tokenizer, "named_templates", {}).values()]
        return any(isinstance(s, str) and "reasoning_content" in s for s in sources)

    async def _messages(self, request: Request) -> Response:
        mapped, namespace = await self._mapped(request, counting=False)
        client = self.front.client(request, namespace)
        stream_id, built, receive = await self.front._start(client, mapped.chat)
        reply = Reply(f"msg_{stream_id}", self.front.model, self.front.services.builder.tokenizer.token_bytes,
                      mapped.stop_sequences, self.front.usage_extension(mapped.chat), len(built.request.tokens))
        events = self.front._events(stream_id, built, receive, client)
        if mapped.chat.stream:
            return StreamingResponse(_sse(reply, events), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        async for event in events:
            reply.add(event)
        assert reply.done is not None, "_events ends with the done event"
        if reply.done.finish_reason == "error":
            raise HttpError(500, reply.done.note or "the generate failed", kind="server_error")
        return JSONResponse(reply.body())

    async def _count_tokens(self, request: Request) -> Response:
        """The prompt's tokens as a generate would render them (system, messages, tools),
        built through the gate's pacing and heavy-work slots; nothing is generated."""
        mapped, namespace = await self._mapped(request, counting=True)
        built = await self.front.build_only(request, mapped.chat, namespace)
        return JSONResponse({"input_tokens": len(built.request.tokens)})


@dataclass
class Reply:
    """What one Messages request has produced so far, and how to spell it Anthropic's way."""

    id: str
    model: str
    token_bytes: Callable[[int], bytes]
    stop_sequences: tuple[str, ...]
    extension: UsageExtension  # usage.prefixd
    num_prompt: int
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    done: DoneEvent | None = None

    def add(self, event: TokenEvent | DoneEvent) -> None:
        if isinstance(event, TokenEvent):
            self.text.append(event.text)
            self.reasoning.append(reasoning_of(event))
            self.ids.extend(event.ids)
            self.extension.add(event)
        else:
            self.done = event

    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        assert self.done is not None, "the stop reason is known once the generate is done"
        reason = self.done.finish_reason
        if reason in _STOP_REASONS:
            return _STOP_REASONS[reason], None
        matched = self._stop_sequence() if reason == "stop" else None
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    def _stop_sequence(self) -> str | None:
        """The stop sequence the reply ended on: the one that begins where the shown text ends
        (the shortest there: it completed first)."""
        shown = "".join(self.text).encode("utf-8")
        generated = b"".join(self.token_bytes(i) for i in self.ids)
        if not generated.startswith(shown):
            return None
        tail = generated[len(shown):]
        matched = [s for s in self.stop_sequences if tail.startswith(s.encode("utf-8"))]
        return min(matched, key=len) if matched else None

    def usage(self, *, final: bool = True) -> dict[str, Any]:
        if final:
            assert self.done is not None, "usage is known once the generate is done"
            u = self.done.usage
            out: dict[str, Any] = {"input_tokens": u.prompt_tokens - u.cached_tokens,
                                   "output_tokens": u.completion_tokens,
                                   "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}
        else:
            out = {"input_tokens": self.num_prompt, "output_tokens": 0, "cache_read_input_tokens": 0,
                   "cache_creation_input_tokens": 0}
        extension = self.extension.usage(self.done if final else None)
        if extension:
            out["prefixd"] = extension
        return out

    def thinking(self) -> dict[str, Any] | None:
        """The thinking block of the reply, or None when it did not think."""
        text = "".join(self.reasoning)
        return {"type": "thinking", "thinking": text, "signature": signature(text)} if text else None

    def tool_uses(self) -> list[dict[str, Any]]:
        assert self.done is not None, "tool calls are known once the generate is done"
        return [{"type": "tool_use", "id": _tool_use_id(call["id"]), "name": call["function"]["name"],
                 "input": _tool_input(call["function"]["arguments"])} for call in self.done.tool_calls or ()]

    def message(self, content: list[dict[str, Any]], *, final: bool) -> dict[str, Any]:
        reason, sequence = self.stop() if final else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": self.usage(final=final)}

    def body(self) -> dict[str, Any]:
        text = "".join(self.text)
        thinking = self.thinking()
        return self.message(([thinking] if thinking else []) + ([{"type": "text", "text": text}] if text else [])
                            + self.tool_uses(), final=True)


def signature(thinking: str) -> str:
    """A thinking block's signature: its text's sha256, so the same thinking signs alike (a
    replayed block's signature is not checked: the template renders the text alone)."""
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as the map tool_use.input is; arguments that are not a
    JSON object are kept as the text under "arguments"."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


async def _sse(reply: Reply, events: AsyncIterator[TokenEvent | DoneEvent]) -> AsyncIterator[str]:
    yield sse("message_start", {"type": "message_start", "message": reply.message([], final=False)})
    yield sse("ping", {"type": "ping"})
    blocks = _Blocks()
    try:
        async for event in events:
            reply.add(event)
            if isinstance(event, TokenEvent):
                for part in blocks.deltas(reply, reasoning_of(event), event.text):
                    yield part
                continue
            if event.finish_reason == "error":
                yield sse("error", error_body(HttpError(500, event.note or "the generate failed")))
                return
            for part in _closing(reply, blocks):
                yield part
    except HttpError as e:
        yield sse("error", error_body(e))


class _Blocks:
    """The content blocks a stream has opened: a thinking block first, then a text block."""

    def __init__(self) -> None:
        self.kind: str | None = None  # the open block's type
        self.num_opened = 0

    def deltas(self, reply: Reply, reasoning: str, text: str) -> list[str]:
        out = []
        if reasoning:
            if self.kind is None:
                out.append(self._open({"type": "thinking", "thinking": "", "signature": ""}))
            out.append(_block_delta(self.num_opened - 1, {"type": "thinking_delta", "thinking": reasoning}))
        if text:
            if self.kind != "text":
                out.extend(self.close(reply))
                out.append(self._open({"type": "text", "text": ""}))
            out.append(_block_delta(self.num_opened - 1, {"type": "text_delta", "text": text}))
        return out

    def close(self, reply: Reply) -> list[str]:
        """The open block's end (a thinking block's signature first); [] when none is open."""
        if self.kind is None:
            return []
        index = self.num_opened - 1
        out = []
        if self.kind == "thinking":
            out.append(_block_delta(index, {"type": "signature_delta", "signature": signature("".join(reply.reasoning))}))
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        self.kind = None
        return out

    def _open(self, block: dict[str, Any]) -> str:
        self.kind = block["type"]
        self.num_opened += 1
        return _block_start(self.num_opened - 1, block)


def _closing(reply: Reply, blocks: _Blocks) -> list[str]:
    """The open block's stop, one block per tool call, message_delta and message_stop."""
    out = blocks.close(reply)
    for index, use in enumerate(reply.tool_uses(), start=blocks.num_opened):
        out.append(_block_start(index, {**use, "input": {}}))
        out.append(_block_delta(index, {"type": "input_json_delta", "partial_json": json.dumps(use["input"])}))
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    reason, sequence = reply.stop()
    delta = {"stop_reason": reason, "stop_sequence": sequence}
    out.append(sse("message_delta", {"type": "message_delta", "delta": delta, "usage": reply.usage()}))
    out.append(sse("message_stop", {"type": "message_stop"}))
    return out


def _block_start(index: int, block: dict[str, Any]) -> str:
    return sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def _block_delta(index: int, delta: dict[str, Any]) -> str:
    return sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
