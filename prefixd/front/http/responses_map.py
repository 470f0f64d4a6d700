"""OpenAI Responses request bodies -> the chat generate map of /v1/chat/completions.

A Responses request is spelled as the Chat Completions request it means (instructions as a
system message, items as messages, function tools as chat tools, `text.format` as
`response_format`) and mapped by `openai_map.map_chat`, so the same conversation through
either API reaches the engine as the same StreamRequest.

Conversation items are kept *normalized* (message content as one string, a reasoning item
as its text): a stored response's items and a client's resent history normalize alike, so a
conversation continued by `previous_response_id` renders the same prompt as the whole
history sent again. A reasoning item becomes the `reasoning_content` of the assistant reply
after it, which a thinking template renders as it renders every turn's (and drops where it
drops them); a client that leaves reasoning items out gets the same prompt from such a
template for all but the replies after the last user message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import dataclasses

from prefixd.front.http.extension import FIELD
from prefixd.front.http.openai_map import HttpError, MappedRequest, _int, effort_switch, map_chat
from prefixd.text.hygiene import DEFAULT_NORMALISERS

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
REASONING_PARTS = ("reasoning_text", "summary_text")
_CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
_SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty")
_REFUSED = ("background", "conversation", "prompt")  # fields with no meaning here: a 400 when set


@dataclass(frozen=True, slots=True)
class MappedResponse:
    """A Responses request as a chat generate map, plus what its answer and the store need."""

    request: MappedRequest
    items: tuple[dict[str, Any], ...]  # the conversation: the previous response's items, then this input
    ignored_tools: tuple[str, ...]  # the types of tools left out (not function tools)
    echo: dict[str, Any]  # request fields the response object repeats


def _bad(message: str, param: str | None) -> HttpError:
    return HttpError(400, message, param=param)


def chat_param(error: HttpError) -> HttpError:
    """`error` with a chat field name (messages, response_format, ...) spelled as Responses names it."""
    if error.param in _CHAT_PARAMS:
        error.param = _CHAT_PARAMS[error.param]
    return error


def map_response(body: dict[str, Any], namespace: str, history: tuple[dict[str, Any], ...],
                 normalisers: tuple[str, ...] = DEFAULT_NORMALISERS) -> MappedResponse:
    """A /v1/responses body, continuing the conversation `history` (normalized items), after
    the prompt hygiene `normalisers`."""
    for name in _REFUSED:
        if body.get(name):
            raise _bad(f"{name}: not supported", name)
    items = history + tuple(normalize_items(body.get("input")))
    tools, ignored = _tools(body.get("tools"))
    chat: dict[str, Any] = {"messages": _instructions(body.get("instructions")) + to_messages(items)}
    max_tokens = _int(body, "max_output_tokens", 1, (1 << 31) - 1)
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    chat.update({k: body[k] for k in _SAMPLING if body.get(k) is not None})
    if body.get(FIELD) is not None:  # prefixd's own switches (extension.py)
        chat[FIELD] = body[FIELD]
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None and (tools or choice != "auto" and choice != "none"):
        chat["tool_choice"] = choice
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if (_int(body, "top_logprobs", 0, 20) or 0) > 0:
        raise _bad("top_logprobs: not supported on /v1/responses (use /v1/chat/completions)", "top_logprobs")
    try:
        mapped = map_chat(chat, namespace, normalisers)
    except HttpError as e:
        raise chat_param(e) from None
    options = dataclasses.replace(mapped.chat, enable_thinking=_effort(body.get("reasoning")))
    mapped = MappedRequest(mapped.generate, bool(body.get("stream")), False, False, options, mapped.normalised)
    return MappedResponse(mapped, items, ignored, _echo(body))


# -- input items --------------------------------------------------------------------------


def normalize_items(raw: Any) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as normalized items; 400 naming a bad item."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _bad("input: must be a string or a non-empty array of items", "input")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise _bad(f"input[{i}]: must be an item map", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            out.append({"type": "reasoning", "text": _reasoning_text(item, f"input[{i}]")})
        elif kind == "message":
            out.append(_message_item(item, f"input[{i}]"))
        elif kind == "function_call":
            out.append({"type": "function_call", "call_id": _str(item, "call_id", i), "name": _str(item, "name", i),
                        "arguments": _str(item, "arguments", i)})
        elif kind == "function_call_output":
            out.append({"type": "function_call_output", "call_id": _str(item, "call_id", i),
                        "output": _text(item.get("output"), f"input[{i}].output")})
        else:
            raise _bad(f"input[{i}].type: {kind!r} is not one of message, function_call, function_call_output, "
                       "reasoning", "input")
    return out


def _effort(reasoning: Any) -> bool | None:
    """`reasoning.effort` as the thinking switch ("none": off; see openai_map.effort_switch)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _bad("reasoning: must be a map", "reasoning")
    return effort_switch(reasoning.get("effort"), "reasoning.effort")


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its content's reasoning_text parts, else its summary's parts."""
    for name in ("content", "summary"):
        parts = item.get(name)
        if parts is None or parts == []:
            continue
        if not isinstance(parts, list):
            raise _bad(f"{where}.{name}: must be a list of parts", "input")
        texts = []
        for k, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") not in REASONING_PARTS \
                    or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.{name}[{k}]: must be a {' or '.join(REASONING_PARTS)} part with its text",
                           "input")
            texts.append(part["text"])
        return "\n\n".join(texts)
    return ""


def _message_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role: must be one of {', '.join(ROLES)}", "input")
    return {"type": "message", "role": role, "content": _text(item.get("content"), f"{where}.content")}


def _str(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise _bad(f"input[{i}].{name}: must be a string", "input")
    return value


def _text(content: Any, where: str) -> str:
    """Content as one string: a string, or text parts joined; other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of text parts", "input")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            raise _bad(f"{where}[{k}]: only text parts ({', '.join(TEXT_PARTS)}) are supported", "input")
        text = part.get("refusal") if part["type"] == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise _bad(f"{where}[{k}]: must carry its text as a string", "input")
        texts.append(text)
    return "".join(texts)


def to_messages(items: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Normalized items as chat messages: a function call joins the assistant message right
    before it (as one chat reply carries its text and its tool calls); a reasoning item is
    the reasoning_content of the assistant message it comes before (it starts one if the
    next item is a call)."""
    messages: list[dict[str, Any]] = []
    joinable = False  # the last message is an assistant reply the next call belongs to
    reasoning = ""  # of the assistant message to come
    for item in items:
        if item["type"] == "reasoning":
            reasoning = "\n\n".join(t for t in (reasoning, item["text"]) if t)
            joinable = False
        elif item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"]})
            joinable = item["role"] == "assistant"
            if joinable and reasoning:
                messages[-1]["reasoning_content"] = reasoning
            reasoning = ""
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not joinable:
                messages.append({"role": "assistant", "content": ""})
                if reasoning:
                    messages[-1]["reasoning_content"] = reasoning
                reasoning = ""
                joinable = True
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            joinable = False
            reasoning = ""
    return messages


def _instructions(instructions: Any) -> list[dict[str, Any]]:
    if instructions is None or instructions == "":
        return []
    if not isinstance(instructions, str):
        raise _bad("instructions: must be a string", "instructions")
    return [{"role": "system", "content": instructions}]


# -- tools and formats --------------------------------------------------------------------


def _tools(raw: Any) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """(function tools as chat tools, the types of the other tools, which are left out)."""
    if raw is None:
        return [], ()
    if not isinstance(raw, list):
        raise _bad("tools: must be an array", "tools")
    tools, ignored = [], []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise _bad(f"tools[{i}]: must be a tool map", "tools")
        if tool.get("type") != "function":
            ignored.append(str(tool.get("type")))
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    return tools, tuple(ignored)


def _tool_choice(raw: Any) -> Any:
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    kind = raw.get("type") if isinstance(raw, dict) else None
    raise _bad(f"tool_choice: {kind!r} cannot be forced here (only auto, none, required or a function)",
               "tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: free text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad(f"text.format.type: {kind!r} is not one of text, json_object, json_schema", "text.format")


def _echo(body: dict[str, Any]) -> dict[str, Any]:
    """The request fields a response object repeats, with OpenAI's defaults."""
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True) is not False,
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation", "disabled"),
        "user": body.get("user"),
    }
