"""Tools in chat prompts, and tool calls parsed out of a reply.

Two template kinds:

- templates that know tools (they mention `tools`, e.g. Qwen's) get `tools` as the template
  variable and assistant `tool_calls` with their arguments as maps, as HF templates expect;
- templates that do not (e.g. SmolLM2-135M's) get the tool definitions in a system message
  and assistant tool calls spelled into the content, both in the `<tool_call>` syntax below.

Either way the tools are part of the rendered messages, so they belong to the cached prefix.

Replies spell calls as `<tool_call>BODY</tool_call>`, BODY being a JSON object
`{"name": ..., "arguments": {...}}`, a JSON array of such objects, or the XML form
`<function=NAME><parameter=KEY>VALUE</parameter>...</function>`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.S)
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)

_TOOLS_PREAMBLE = (
    "You may call functions to answer. Their signatures, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call functions, reply with only this and no other text:\n"
    '<tool_call>[{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}]</tool_call>\n'
    "Otherwise answer in plain text."
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model asked for; `arguments` is JSON text, as OpenAI's API spells it."""

    id: str
    name: str
    arguments: str

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def template_knows_tools(source: str | None) -> bool:
    """True when a chat template renders `tools` itself."""
    return bool(source) and "tools" in source  # type: ignore[operator]


def prepare_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 template_source: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand the chat template; see the module docstring. Returns new
    lists; the inputs are not changed."""
    if template_knows_tools(template_source):
        return [_native_message(m) for m in messages], (list(tools) if tools else None)
    out = [_spelled_message(m) for m in messages]
    if tools:
        out = _with_tools_system(out, tools)
    return out, None


def _arguments_map(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _calls_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        calls.append({"name": function.get("name"), "arguments": _arguments_map(function.get("arguments", {}))})
    return calls


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if message.get("tool_calls"):
        out["content"] = message.get("content") or ""
        out["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _arguments_map(call["function"].get("arguments"))}}
            if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
            for call in message["tool_calls"]
        ]
    return out


def _spelled_message(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    spelled = TOOL_CALL_OPEN + json.dumps(_calls_of(message), ensure_ascii=False) + TOOL_CALL_CLOSE
    content = message.get("content") or ""
    out["content"] = f"{content}\n{spelled}" if content else spelled
    return out


def _with_tools_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    listed = "\n".join(json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools)
    preamble = _TOOLS_PREAMBLE.format(tools=listed)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{preamble}".lstrip("\n")
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def parse_tool_calls(text: str) -> tuple[str, tuple[ToolCall, ...]] | None:
    """(content outside the calls, the calls) of a reply, or None when it has no call or a
    call that does not parse (the reply is then plain text)."""
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        return None
    calls: list[tuple[str, str]] = []
    for block in blocks:
        parsed = _parse_block(block.group(1).strip())
        if parsed is None:
            return None
        calls.extend(parsed)
    content = _BLOCK.sub("", text).strip()
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    return content, tuple(ToolCall(f"call_{digest}_{i}", name, args) for i, (name, args) in enumerate(calls))


def _parse_block(body: str) -> list[tuple[str, str]] | None:
    if body.startswith("<function="):
        return _parse_xml(body)
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        call = _json_call(item)
        if call is None:
            return None
        out.append(call)
    return out


def _json_call(item: Any) -> tuple[str, str] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        return item["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments, ensure_ascii=False)


def _parse_xml(body: str) -> list[tuple[str, str]] | None:
    out = []
    for function in _XML_FUNCTION.finditer(body):
        arguments = {key: _xml_value(value) for key, value in _XML_PARAMETER.findall(function.group(2))}
        out.append((function.group(1), json.dumps(arguments, ensure_ascii=False)))
    return out or None


def _xml_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ToolCallSplitter:
    """Streamed reply text in, text safe to show out: from the first `<tool_call>` on, text
    is held back (a call is not shown as text). `finish()` parses what was held."""

    def __init__(self) -> None:
        self._held = ""
        self._capturing = False

    def push(self, text: str) -> str:
        if self._capturing:
            self._held += text
            return ""
        buf = self._held + text
        at = buf.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._capturing = True
            self._held = buf[at:]
            return buf[:at]
        keep = _marker_prefix_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """(text still to show, parsed calls). Held text that does not parse is shown."""
        held, self._held = self._held, ""
        if not self._capturing:
            return held, ()
        parsed = parse_tool_calls(held)
        if parsed is None:
            return held, ()
        content, calls = parsed
        return (f"\n{content}" if content else ""), calls


def _marker_prefix_len(buf: str) -> int:
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(buf)), 0, -1):
        if buf.endswith(TOOL_CALL_OPEN[:k]):
            return k
    return 0
