"""Anthropic Messages request bodies -> the equivalent chat completions body -> map_chat.

A Messages request is spelled as the Chat Completions request that says the same thing and
then goes through `openai_map.map_chat`, so the same conversation through either API is the
same generate map and reaches the engine as the same StreamRequest (same tokens, same
chunk starts, same bits):

    system (string or text blocks)        -> a system message (after prompt hygiene)
    system-role messages in messages      -> their text after system's, in that system message
    user text blocks                      -> a user message
    user tool_result blocks               -> tool messages (tool_call_id = tool_use_id)
    assistant text / tool_use blocks      -> an assistant message with content / tool_calls
    assistant thinking blocks             -> reasoning_content where the template renders it, else dropped
    tools {name, description, input_schema} -> function tools {name, description, parameters}
    tool_choice auto | any | tool | none  -> auto | required | a named function | none
    stop_sequences, top_k, ...            -> stop, top_k, ...
    thinking {type: enabled | disabled}   -> the template's enable_thinking, where it reads it

The text blocks of one message (and of `system`) are joined with a blank line between.
`cache_control` on any block is accepted and ignored: prefixd caches every prefix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from prefixd.front.http.extension import FIELD
from prefixd.front.http.openai_map import HttpError, MappedRequest, map_chat
from prefixd.text.hygiene import applied_in_order, normalise_system

JOIN = "\n\n"  # between the text blocks of one message
ERROR_PREFIX = "Error: "  # before the text of a tool_result with is_error
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_KNOWN_BLOCKS = ("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking")


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A Messages request as a chat completions generate, plus what the answer spells."""

    chat: MappedRequest
    stop_sequences: tuple[str, ...]
    normalised: tuple[str, ...]  # the hygiene normalisers that changed the request


def _bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, param=param)


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _bad(f"{where}: must be a content block, a map with a type", "messages")
    kind = block["type"]
    if kind not in _KNOWN_BLOCKS:
        raise _bad(f"{where}.type: unknown content block type {kind!r}", "messages")
    if kind in ("image", "document"):
        raise _bad(f"{where}: {kind} blocks are not supported (text only)", "messages")
    return kind


def _string(block: dict[str, Any], key: str, where: str, *, empty: bool = True) -> str:
    value = block.get(key)
    if not isinstance(value, str) or (not empty and not value):
        raise _bad(f"{where}.{key}: must be a {'' if empty else 'non-empty '}string", "messages")
    return value


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content: must be a string or an array of content blocks", "messages")
    return content


def _texts(content: Any, where: str) -> str:
    """Text-only content (system, a tool_result's content) joined as one string."""
    if content is None:
        return ""
    texts = []
    for j, block in enumerate(_blocks(content, where)):
        if _kind(block, f"{where}[{j}]") != "text":
            raise _bad(f"{where}[{j}]: only text blocks may be here", "messages")
        texts.append(_string(block, "text", f"{where}[{j}]"))
    return JOIN.join(texts)


def _system_blocks(system: Any) -> list[str]:
    if system is None:
        return []
    blocks = _blocks(system, "system")
    out = []
    for j, block in enumerate(blocks):
        if _kind(block, f"system[{j}]") != "text":
            raise _bad(f"system[{j}]: only text blocks may be in system", "system")
        out.append(_string(block, "text", f"system[{j}]"))
    return out


def _assistant(blocks: list[dict[str, Any]], where: str, reasoning: bool, made: set[str]) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", at))
        elif kind == "tool_use":
            call_id, name = _string(block, "id", at, empty=False), _string(block, "name", at, empty=False)
            if not isinstance(block.get("input"), dict):
                raise _bad(f"{at}.input: must be a map", "messages")
            made.add(call_id)
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": block["input"]}})
        elif kind == "tool_result":
            raise _bad(f"{at}: tool_result blocks belong in user messages", "messages")
        # redacted_thinking: nothing a template could render
    message: dict[str, Any] = {"role": "assistant", "content": JOIN.join(texts)}
    if calls:
        message["tool_calls"] = calls
    if reasoning and thoughts:
        message["reasoning_content"] = JOIN.join(thoughts)
    return message


def _user(blocks: list[dict[str, Any]], where: str, made: set[str]) -> list[dict[str, Any]]:
    """User blocks in order: each run of text blocks a user message, each tool_result a tool message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_string(block, "text", at))
            continue
        if kind != "tool_result":
            raise _bad(f"{at}: {kind} blocks belong in assistant messages", "messages")
        if texts:
            out.append({"role": "user", "content": JOIN.join(texts)})
            texts = []
        call_id = _string(block, "tool_use_id", at, empty=False)
        if call_id not in made:
            raise _bad(f"{at}.tool_use_id: {call_id!r} is not the id of a tool_use in an earlier assistant message",
                       "messages")
        text = _texts(block.get("content"), f"{at}.content")
        if block.get("is_error") is True:
            text = ERROR_PREFIX + text
        out.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if texts or not out:
        out.append({"role": "user", "content": JOIN.join(texts)})
    return out


def late_system(messages: Any) -> list[str]:
    """The text of the system-role messages inside `messages` (Claude Code sends its
    environment block as one, after the first user message; chat_messages skips them). Their
    text joins the system prompt, after `system`: many chat templates take a system
    message only first, and a system prompt that holds it stays put as the turns grow, where a
    system message kept among the turns would move (and end the cached prefix) each turn."""
    if not isinstance(messages, list):
        return []
    texts = [_texts(m.get("content"), f"messages[{i}].content") for i, m in enumerate(messages)
             if isinstance(m, dict) and m.get("role") == "system"]
    return [t for t in texts if t]


def chat_messages(system: list[str], messages: Any, *, reasoning: bool) -> list[dict[str, Any]]:
    """The chat completions messages saying what `system` (hygienic text blocks) and the
    Messages `messages` say (their system-role messages are in `system`, late_system).
    `reasoning`: the chat template renders `reasoning_content`."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: must be a non-empty array", "messages")
    out: list[dict[str, Any]] = [{"role": "system", "content": JOIN.join(system)}] if system else []
    made: set[str] = set()  # tool_use ids of the assistant messages so far
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise _bad(f"{where}.role: must be user, assistant or system", "messages")
        if message["role"] == "system":  # in the system prompt already (late_system)
            continue
        blocks = _blocks(message.get("content"), where)
        if message["role"] == "assistant":
            out.append(_assistant(blocks, where, reasoning, made))
        else:
            out.extend(_user(blocks, where, made))
    turns = [m for m in messages if m["role"] != "system"]
    if not turns:
        raise _bad("messages: must hold a user message", "messages")
    if turns[-1]["role"] == "assistant":
        raise _bad("messages: a last assistant message (a prefill to continue) is not supported", "messages")
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools: must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"tools[{i}].type: {kind!r} is not supported (custom tools only)", "tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad(f"tools[{i}].name: must be a non-empty string", "tools")
        function: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("input_schema") is not None:
            function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name: must be a tool's name", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind not in _TOOL_CHOICES:
        raise _bad("tool_choice: must be {type: auto | any | tool | none}", "tool_choice")
    return _TOOL_CHOICES[kind]


def _stop_sequences(body: dict[str, Any]) -> tuple[str, ...]:
    stops = body.get("stop_sequences")
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop_sequences: must be an array of non-empty strings", "stop_sequences")
    return tuple(stops)


def thinking_switch(thinking: Any) -> bool | None:
    """`thinking` as the template's enable_thinking: enabled (or adaptive) on, disabled off,
    absent None (the template's default). budget_tokens is accepted; max_tokens bounds the reply."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise _bad("thinking: must be {type: enabled | disabled}", "thinking")
    return kind != "disabled"


def user_id(body: dict[str, Any]) -> str:
    """`metadata.user_id`, the cache namespace when no header names one ("" when absent)."""
    metadata = body.get("metadata")
    value = metadata.get("user_id") if isinstance(metadata, dict) else None
    return value if isinstance(value, str) else ""


def map_messages(body: dict[str, Any], namespace: str, *, reasoning: bool, normalisers: tuple[str, ...],
                 counting: bool = False) -> MessagesRequest:
    """A /v1/messages body (or, `counting`, a /v1/messages/count_tokens body: no max_tokens)
    as a generate map, through the chat completions body that says the same."""
    if not counting and body.get("max_tokens") is None:
        raise _bad("max_tokens: required", "max_tokens")
    messages = body.get("messages")
    system, normalised = normalise_system(_system_blocks(body.get("system")) + late_system(messages), normalisers)
    stops = _stop_sequences(body)
    chat: dict[str, Any] = {
        "messages": chat_messages(system, messages, reasoning=reasoning),
        "max_tokens": 1 if counting else body["max_tokens"],
        "stop": list(stops) or None,
        "tools": chat_tools(body.get("tools")),
        "tool_choice": chat_tool_choice(body.get("tool_choice")),
        "stream": bool(body.get("stream")),
        **{name: body.get(name) for name in ("temperature", "top_p", "top_k", FIELD)},
    }
    mapped = map_chat({k: v for k, v in chat.items() if v is not None}, namespace, normalisers)
    options = dataclasses.replace(mapped.chat, enable_thinking=thinking_switch(body.get("thinking")))
    mapped = dataclasses.replace(mapped, chat=options, normalised=applied_in_order(normalisers, normalised,
                                                                                   mapped.normalised))
    return MessagesRequest(mapped, stops, mapped.normalised)
