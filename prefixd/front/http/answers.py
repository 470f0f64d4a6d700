"""prefixd events -> OpenAI response bodies and server-sent-event chunks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from prefixd.front.http.extension import UsageExtension
from prefixd.front.output import reasoning_of
from prefixd.ipc.events import DoneEvent, TokenEvent

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop", "error": "stop"}


@dataclass
class Answer:
    """What one request has produced so far, and how to spell it the OpenAI way."""

    id: str
    model: str
    created: int
    chat: bool
    token_text: Callable[[int], bytes]
    extension: UsageExtension  # usage.prefixd
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    done: DoneEvent | None = None

    def add(self, event: TokenEvent) -> None:
        self.text.append(event.text)
        self.reasoning.append(reasoning_of(event))
        self.extension.add(event)
        self.logprobs.extend(self.logprob_entry(entry) for entry in event.logprobs or ())

    def logprob_entry(self, entry: dict[str, Any]) -> dict[str, Any]:
        def token(i: int) -> dict[str, Any]:
            raw = self.token_text(i)
            return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}

        return {**token(entry["id"]), "logprob": entry["logprob"],
                "top_logprobs": [{**token(t["id"]), "logprob": t["logprob"]} for t in entry["top"]]}

    # -- whole answers ----------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        assert self.done is not None, "usage is known once the generate is done"
        u = self.done.usage
        out: dict[str, Any] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                               "total_tokens": u.prompt_tokens + u.completion_tokens,
                               "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
                               "prefixd": self.extension.usage(self.done)}
        return out

    def body(self, want_logprobs: bool) -> dict[str, Any]:
        assert self.done is not None, "the body is known once the generate is done"
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH[self.done.finish_reason]}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            reasoning = "".join(self.reasoning)
            if reasoning:  # the same text by both names clients read it by
                message["reasoning_content"] = message["reasoning"] = reasoning
            if self.done.tool_calls:
                message["tool_calls"] = [dict(c) for c in self.done.tool_calls]
            elif message["content"] is None:
                message["content"] = ""
            choice["message"] = message
            choice["logprobs"] = {"content": self.logprobs} if want_logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs() if want_logprobs else None
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}

    def _completion_logprobs(self) -> dict[str, Any]:
        return {"tokens": [e["token"] for e in self.logprobs], "token_logprobs": [e["logprob"] for e in self.logprobs],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in self.logprobs],
                "text_offset": []}

    # -- streamed answers -------------------------------------------------------------------

    def chunk(self, delta: dict[str, Any] | None = None, *, finish: str | None = None,
              logprobs: list[dict[str, Any]] | None = None, usage: bool = False) -> str:
        """One server-sent event holding a chunk."""
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                "created": self.created, "model": self.model}
        if usage:
            body["choices"] = []
            body["usage"] = self.usage()
        else:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if self.chat:
                choice["delta"] = delta or {}
                choice["logprobs"] = None if logprobs is None else {"content": logprobs}
            else:
                choice["text"] = (delta or {}).get("content", "")
                choice["logprobs"] = None
            body["choices"] = [choice]
        return sse(body)

    def tool_call_deltas(self) -> list[dict[str, Any]]:
        assert self.done is not None, "tool calls are known once the generate is done"
        return [{"index": i, **dict(call)} for i, call in enumerate(self.done.tool_calls or ())]


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
