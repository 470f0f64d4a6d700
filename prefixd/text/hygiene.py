"""Prompt hygiene: named rewrites of a request that keep consecutive turns' prefixes equal.

A client that writes a per-request value (a nonce, a timestamp) near the start of its system
prompt, or lists its tools in a different order from one turn to the next, makes every
turn's prompt differ from the last within its first tokens, so no cached prefix can serve
it. A normaliser undoes such a difference and nothing else. `NORMALISERS` names each; a front
applies those it is given (`DEFAULT_NORMALISERS` unless `--prompt-hygiene` says otherwise)
and reports in usage which changed the request.

    billing_header   Claude Code's `x-anthropic-billing-header: cc_version=...; cch=<nonce>;`
                     line, at the start of a system text block (often a block of its own),
                     is removed (Messages: the only API that client speaks)
    tool_order       tool definitions are sorted by name (a stable sort: tools of one name keep
                     their order), so they render alike whatever order a turn lists them in
"""

from __future__ import annotations

import re
from typing import Any, Callable

BILLING_HEADER = "billing_header"
TOOL_ORDER = "tool_order"

# The header line where it begins a block, with its line break; what follows is kept as sent.
_BILLING_LINE = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n|\Z)", re.IGNORECASE)


def strip_billing_header(blocks: list[str]) -> list[str]:
    """`blocks` (a system prompt's text blocks, in order) without a leading billing-header
    line in any block; a block that held only the line is left out."""
    out = []
    for text in blocks:
        kept = _BILLING_LINE.sub("", text, count=1)
        if kept or kept == text:
            out.append(kept)
    return out


def tool_name(tool: Any) -> str:
    """A chat tool's name ({"type": "function", "function": {"name"}} or {"name"}); "" if none."""
    if not isinstance(tool, dict):
        return ""
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    return name if isinstance(name, str) else ""


def sort_tools(tools: list[Any]) -> list[Any]:
    """`tools` sorted by name; tools of equal names keep their order. A new list."""
    return sorted(tools, key=tool_name)


SYSTEM_NORMALISERS: dict[str, Callable[[list[str]], list[str]]] = {BILLING_HEADER: strip_billing_header}
TOOL_NORMALISERS: dict[str, Callable[[list[Any]], list[Any]]] = {TOOL_ORDER: sort_tools}
NORMALISERS: tuple[str, ...] = (BILLING_HEADER, TOOL_ORDER)
DEFAULT_NORMALISERS: tuple[str, ...] = (BILLING_HEADER, TOOL_ORDER)


def hygiene_names(text: str | tuple[str, ...]) -> tuple[str, ...]:
    """`--prompt-hygiene`'s value: comma-separated NORMALISERS names, or "none" for no rule.
    ValueError naming what was expected."""
    if isinstance(text, tuple):
        return text
    names = tuple(name.strip() for name in str(text).split(",") if name.strip())
    if names == ("none",):
        return ()
    unknown = [name for name in names if name not in NORMALISERS]
    if unknown or not names:
        raise ValueError(f"expected none or comma-separated names from {', '.join(NORMALISERS)}")
    return tuple(dict.fromkeys(names))


def _apply(value: list[Any], names: tuple[str, ...], rules: dict[str, Callable[[list[Any]], list[Any]]]
           ) -> tuple[list[Any], tuple[str, ...]]:
    applied = []
    for name in names:
        if name not in rules:
            continue
        changed = rules[name](value)
        if changed != value:
            applied.append(name)
        value = changed
    return list(value), tuple(applied)


def normalise_system(blocks: list[str], names: tuple[str, ...]) -> tuple[list[str], tuple[str, ...]]:
    """(the system text blocks after the system normalisers among `names`, in order; the
    names of those that changed something). A new list; `blocks` is not changed."""
    return _apply(blocks, names, SYSTEM_NORMALISERS)


def normalise_tools(tools: list[Any], names: tuple[str, ...]) -> tuple[list[Any], tuple[str, ...]]:
    """(the tool definitions after the tool normalisers among `names`; the names of those that
    changed something). A new list; `tools` is not changed."""
    return _apply(tools, names, TOOL_NORMALISERS)


def applied_in_order(names: tuple[str, ...], *applied: tuple[str, ...]) -> tuple[str, ...]:
    """The names in any of `applied`, in the order of `names` (for usage)."""
    seen = {name for group in applied for name in group}
    return tuple(name for name in names if name in seen)
