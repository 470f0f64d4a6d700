"""Reasoning in replies: the `<think>...</think>` span some chat templates' models write first.

A template thinks when it mentions `<think>`, `enable_thinking` or `reasoning_content`
(Qwen3's and its family's). Its model's reply opens with the span, or, where the template
writes `<think>` into the generation prompt itself, starts inside it; `opens_thinking` reads
that from the rendered prompt's tail. Only a span at the start of the reply is reasoning: a
`<think>` later on is text.

    reply:  [ws] <think> [ws] REASONING [ws] </think> [ws] CONTENT
                          ^ reasoning, its ends stripped ^        ^ content, leading ws stripped
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_MARKS = (THINK_OPEN, "enable_thinking", "reasoning_content")

# ReasoningSplitter states
_BEFORE = "before"  # nothing but whitespace yet: the reply may still open a span
_OPENING = "opening"  # just inside the span: its leading whitespace is dropped
_INSIDE = "inside"
_CLOSING = "closing"  # just past the span: the content's leading whitespace is dropped
_AFTER = "after"


def template_thinks(source: str | None) -> bool:
    """True when a chat template's model writes a think span (see the module docstring)."""
    return bool(source) and any(mark in source for mark in _MARKS)  # type: ignore[operator]


def template_switches_thinking(source: str | None) -> bool:
    """True when a chat template reads `enable_thinking` (a request may switch it)."""
    return bool(source) and "enable_thinking" in source  # type: ignore[operator]


def opens_thinking(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside a think span, so the reply starts in it."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


class ReasoningSplitter:
    """Streamed reply text in, (reasoning, content) out. Text that may still turn out to be a
    tag, or whitespace at an end of the reasoning, is held back until the next push decides
    it; `finish()` gives what is held. `inside`: the reply starts inside the span."""

    def __init__(self, *, inside: bool = False) -> None:
        self._state = _OPENING if inside else _BEFORE
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) safe to show for `text` and what was held before it."""
        buf, self._held = self._held + text, ""
        reasoning = ""
        if self._state == _BEFORE:
            stripped = buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._state, buf = _OPENING, stripped[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(stripped):
                self._held = buf
                return "", ""
            else:
                self._state = _AFTER
        if self._state == _OPENING:
            buf = buf.lstrip()
            if not buf:
                return "", ""
            self._state = _INSIDE
        if self._state == _INSIDE:
            at = buf.find(THINK_CLOSE)
            if at < 0:
                keep = _held_tail(buf)
                self._held = buf[len(buf) - keep:]
                return buf[: len(buf) - keep], ""
            reasoning, buf = buf[:at].rstrip(), buf[at + len(THINK_CLOSE):]
            self._state = _CLOSING
        if self._state == _CLOSING:
            buf = buf.lstrip()
            if not buf:
                return reasoning, ""
            self._state = _AFTER
        return reasoning, buf

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held: an unclosed span's text is reasoning (a reply cut
        off while thinking), a reply that never opened one keeps its text as content."""
        held, self._held = self._held, ""
        if self._state in (_OPENING, _INSIDE):
            return held.rstrip(), ""
        return "", held if self._state in (_BEFORE, _AFTER) else ""


def _held_tail(buf: str) -> int:
    """How many characters at the end of `buf` to hold: a partial `</think>` or whitespace
    (which is the reasoning's if the span closes next)."""
    for k in range(min(len(THINK_CLOSE) - 1, len(buf)), 0, -1):
        if buf.endswith(THINK_CLOSE[:k]):
            return k + len(buf[:-k]) - len(buf[:-k].rstrip())
    return len(buf) - len(buf.rstrip())
