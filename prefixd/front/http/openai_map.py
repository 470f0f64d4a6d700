"""OpenAI request bodies -> prefixd generate maps (protocol v2), and OpenAI's error shape.

Fields OpenAI defines but prefixd cannot honour are refused with a 400 naming them (never
silently dropped); fields that only carry metadata (`metadata`, `store`, ...) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixd.front.http.extension import request_fields
from prefixd.front.requests import ChatOptions
from prefixd.text.hygiene import DEFAULT_NORMALISERS, normalise_tools

DEFAULT_MAX_TOKENS = 1024
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # "none" turns thinking off


class HttpError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class MappedRequest:
    """A generate map for the daemon, plus what the HTTP answer needs."""

    generate: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: bool
    chat: ChatOptions = ChatOptions()  # the thinking switch, and reasoning parsed out of the reply
    normalised: tuple[str, ...] = ()  # the hygiene normalisers that changed the request


def _bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, param=param)


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) not in (int, float) or not lo <= value <= hi:
        raise _bad(f"{name}: must be a number in [{lo}, {hi}]", name)
    return float(value)


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(f"{name}: must be an integer in [{lo}, {hi}]", name)
    return value


def _content_text(content: Any, where: str) -> Any:
    """OpenAI content: a string, or a list of parts of which only text parts are supported."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{i}]: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"{where}.content: must be a string or a list of text parts", "messages")


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise _bad("messages: must be a non-empty array", "messages")
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}]: must be a map with a role", "messages")
        m = {k: v for k, v in message.items() if v is not None and k not in ("name", "reasoning")}
        if m["role"] == "assistant":
            reasoning = _reasoning_text(message, f"messages[{i}]")
            m.pop("reasoning_content", None)
            if reasoning:
                m["reasoning_content"] = reasoning
        content = _content_text(message.get("content"), f"messages[{i}]")
        m["content"] = content if content is not None else ""
        if m["role"] == "developer":
            m["role"] = "system"
        out.append(m)
    return out


def _reasoning_text(message: dict[str, Any], where: str) -> str:
    """A replayed assistant message's reasoning: `reasoning_content`, or `reasoning` (the
    same text by its other name), rendered where the template renders reasoning_content."""
    value = message.get("reasoning_content")
    if value is None:
        value = message.get("reasoning")
    if value is not None and not isinstance(value, str):
        raise _bad(f"{where}.reasoning_content: must be a string", "messages")
    return value or ""


def thinking_switch(body: dict[str, Any]) -> bool | None:
    """The chat body's thinking switch: chat_template_kwargs.enable_thinking, else
    enable_thinking, else reasoning_effort ("none": off, any other effort: on); None: unset."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs: must be a map", "chat_template_kwargs")
    for value, name in (((kwargs or {}).get("enable_thinking"), "chat_template_kwargs.enable_thinking"),
                        (body.get("enable_thinking"), "enable_thinking")):
        if value is not None:
            if not isinstance(value, bool):
                raise _bad(f"{name}: must be true or false", name)
            return value
    return effort_switch(body.get("reasoning_effort"), "reasoning_effort")


def effort_switch(effort: Any, name: str) -> bool | None:
    """A reasoning effort as the thinking switch: "none" off, another effort on, None unset."""
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise _bad(f"{name}: must be one of {', '.join(REASONING_EFFORTS)}", name)
    return effort != "none"


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    sampling = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0),
        "top_k": _int(body, "top_k", 0, 1 << 31),
        "min_p": _number(body, "min_p", 0.0, 1.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.01, 100.0),
        "seed": _int(body, "seed", -(1 << 63), (1 << 64) - 1),
    }
    if sampling["seed"] is not None:
        sampling["seed"] %= 1 << 64  # OpenAI seeds may be negative
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, -2.0, 2.0):
            raise _bad(f"{name}: not supported (use repetition_penalty)", name)
    if body.get("logit_bias"):
        raise _bad("logit_bias: not supported", "logit_bias")
    return {k: v for k, v in sampling.items() if v is not None}


def _common(body: dict[str, Any], namespace: str) -> dict[str, Any]:
    n = _int(body, "n", 1, 128)
    if n is not None and n > 1:
        raise _bad("n: only n=1 is supported", "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop: must be a non-empty string or an array of them", "stop")
    max_tokens = _int(body, "max_completion_tokens", 1, (1 << 31) - 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, (1 << 31) - 1)
    out: dict[str, Any] = {
        "type": "generate",
        "max_tokens": max_tokens or DEFAULT_MAX_TOKENS,
        "sampling": _sampling(body),
        "stop": stop or None,
        "namespace": namespace or None,
        **request_fields(body, _bad),
    }
    return {k: v for k, v in out.items() if v is not None}


def map_chat(body: dict[str, Any], namespace: str,
             normalisers: tuple[str, ...] = DEFAULT_NORMALISERS) -> MappedRequest:
    """A /v1/chat/completions body as a generate map, after the prompt hygiene `normalisers`
    (prefixd/text/hygiene.py) that apply to it."""
    generate = _common(body, namespace)
    generate["messages"] = _messages(body.get("messages"))
    for name in ("tools", "tool_choice", "response_format"):
        if body.get(name) is not None:
            generate[name] = body[name]
    normalised: tuple[str, ...] = ()
    if isinstance(generate.get("tools"), list):
        generate["tools"], normalised = normalise_tools(generate["tools"], normalisers)
    if body.get("response_format") == {"type": "text"}:
        del generate["response_format"]
    want_logprobs = bool(body.get("logprobs"))
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not want_logprobs:
        raise _bad("top_logprobs: needs logprobs: true", "top_logprobs")
    if want_logprobs:
        generate["logprobs"] = top or 0
    chat = ChatOptions(enable_thinking=thinking_switch(body), reasoning=True)
    return MappedRequest(generate, bool(body.get("stream")), _include_usage(body), want_logprobs, chat, normalised)


def map_completion(body: dict[str, Any], namespace: str) -> MappedRequest:
    """A /v1/completions body as a generate map (one prompt string)."""
    generate = _common(body, namespace)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt: must be one non-empty string", "prompt")
    for name in ("echo", "suffix"):
        if body.get(name):
            raise _bad(f"{name}: not supported", name)
    if (_int(body, "best_of", 1, 128) or 1) > 1:
        raise _bad("best_of: only 1 is supported", "best_of")
    generate["prompt"] = prompt
    top = _int(body, "logprobs", 0, 20)
    if top is not None:
        generate["logprobs"] = top
    return MappedRequest(generate, bool(body.get("stream")), _include_usage(body), top is not None)


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
