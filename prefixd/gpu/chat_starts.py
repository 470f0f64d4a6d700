"""Where each chat message starts, in linear time, with the prefix-render definition's values.

The definition (chat.py's docstring) renders every prefix messages[:i]: N renders of up to N
messages, quadratic. Instead:

1. render once with markers: the instrumented template emits a nonce-tagged marker for
   message i first in every loop body that visits it; the last marker of each message gives
   its candidate start, and the text without the markers must equal the plain render;
   message 0's start always comes from the definition (one render of no messages);
2. the marker positions stand for conversations over MAX_PREFIX_RENDERS messages; up to
   that, the definition itself is computed prefix by prefix (at most MAX_PREFIX_RENDERS
   renders of at most as many messages: bounded). The two agree on templates that render a
   prefix as the full conversation begins (the usual case: tests hold SmolLM2's and Qwen's);
   where a template renders earlier messages differently once later ones exist (Qwen3
   drops reasoning before the last query), a marker is the message's header, which the
   definition would place inside that message.

The generation prompt's start always comes from the definition (one more render).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from prefixd.gpu.chat import ChatTemplate, ChatTemplateError, ChatTooLarge, RenderCancelled

if TYPE_CHECKING:
    from prefixd.gpu.tokenizer import Tokenizer

MAX_PREFIX_RENDERS = 256  # the quadratic definition is computed only up to this many messages


class StartFinder:
    """Renders one conversation (plain, marked, or a prefix) and finds its character starts."""

    def __init__(self, template: ChatTemplate, messages: list[dict], *, tools: list | None,
                 kwargs: Mapping[str, Any], should_stop: Callable[[], bool] | None, nonce: str) -> None:
        self._template = template
        self._messages = messages
        self._tools = tools
        self._kwargs = dict(kwargs)
        self._should_stop = should_stop
        self._index = {id(m): i for i, m in enumerate(messages)}
        self._nonce = nonce
        self._marker = re.compile("\ue000" + re.escape(nonce) + r"\.(\d+)\ue001")

    def poll(self) -> None:
        """RenderCancelled when the caller's should_stop() is true."""
        if self._should_stop is not None and self._should_stop():
            raise RenderCancelled("the render was abandoned: its client has gone")

    def _mark_nothing(self, item: Any) -> str:
        self.poll()
        return ""

    def _mark_message(self, item: Any) -> str:
        self.poll()
        i = self._index.get(id(item))
        return "" if i is None else f"\ue000{self._nonce}.{i}\ue001"

    def render(self, messages: list[dict], *, add_generation_prompt: bool, marked: bool = False) -> str:
        """The template's text (with message markers when `marked`), polling should_stop per loop item."""
        mark = None
        if self._template.can_mark:
            mark = self._mark_message if marked else self._mark_nothing
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, tools=self._tools,
                                     mark=mark, **self._kwargs)

    def char_starts(self, text: str, *, add_generation_prompt: bool) -> list[int]:
        """Character offset in `text` where each message (and the generation prompt) starts."""
        num = len(self._messages)
        if num <= MAX_PREFIX_RENDERS:
            starts = self._defined_starts(text, range(num))
        else:
            starts = self._fast_starts(text, add_generation_prompt=add_generation_prompt)
        if add_generation_prompt:
            starts.append(self._defined_starts(text, [num], previous=starts)[0])
        return starts

    def _fast_starts(self, text: str, *, add_generation_prompt: bool) -> list[int]:
        candidates = self._marked_starts(text, add_generation_prompt=add_generation_prompt)
        if candidates is None:
            raise ChatTooLarge(f"{len(self._messages)} messages; this model's chat template can be located "
                               f"in at most {MAX_PREFIX_RENDERS} messages")
        # A template that renders a system message before its loop marks message 0 late.
        candidates[0] = self._defined_starts(text, [0])[0]
        return candidates

    def _marked_starts(self, text: str, *, add_generation_prompt: bool) -> list[int] | None:
        """Marker positions, or None when markers are unusable for this template or conversation."""
        if not self._template.can_mark or len(self._index) != len(self._messages):
            return None
        marked = self.render(self._messages, add_generation_prompt=add_generation_prompt, marked=True)
        found: dict[int, int] = {}
        pieces: list[str] = []
        pos = length = 0
        for match in self._marker.finditer(marked):
            pieces.append(marked[pos:match.start()])
            length += match.start() - pos
            pos = match.end()
            found[int(match.group(1))] = length  # the last loop to visit a message renders it
        pieces.append(marked[pos:])
        if "".join(pieces) != text:
            return None
        starts: list[int] = []
        for i in range(len(self._messages)):
            starts.append(found.get(i, starts[-1] if starts else 0))
        if any(b < a for a, b in zip(starts[1:], starts[2:])):
            return None
        return starts

    def _defined_starts(self, text: str, cuts: Sequence[int] | range, previous: Sequence[int] = ()) -> list[int]:
        """The definition at each cut: a refused prefix repeats the previous start."""
        starts: list[int] = []
        for i in cuts:
            start = self._prefix_start(i, text)
            if start is None:
                earlier = starts or list(previous)
                start = earlier[-1] if earlier else 0
            starts.append(start)
        return starts

    def _prefix_start(self, i: int, text: str) -> int | None:
        """Where render(messages[:i]) and `text` first differ; None if the template refuses it."""
        self.poll()
        try:
            prefix = self.render(self._messages[:i], add_generation_prompt=False)
        except ChatTemplateError:
            return None
        return common_prefix_len(prefix, text)


def defined_char_starts(template: ChatTemplate, messages: list[dict], text: str, *, add_generation_prompt: bool,
                        tools: list | None = None, kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The definition computed prefix by prefix (quadratic): the reference the fast path must match."""
    finder = StartFinder(template, messages, tools=tools, kwargs=kwargs or {}, should_stop=None, nonce="0")
    cuts = list(range(len(messages))) + ([len(messages)] if add_generation_prompt else [])
    return finder._defined_starts(text, cuts)  # noqa: SLF001 - the same object's definition


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b` (bisection over C-speed compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def token_positions(tokenizer: Tokenizer, text: str, ids: list[int], char_starts: list[int]) -> list[int]:
    """Map character offsets to token positions (floor to the token covering the offset).

    Linear in the text: byte offsets come from one pass over the sorted character offsets.
    """
    bounds = tokenizer.offsets_bytes(ids)
    if bounds[-1] == len(text.encode("utf-8")):
        byte_of = _byte_offsets(text, char_starts)
        targets = [byte_of[c] for c in char_starts]
    else:
        # Tokens whose bytes do not spell the text (sentencepiece spaces): use char offsets.
        bounds = tokenizer.token_char_starts(text) + [len(text)]
        targets = list(char_starts)
    positions: list[int] = []
    k = 0
    for target in targets:
        while k + 1 < len(bounds) and bounds[k + 1] <= target:
            k += 1
        positions.append(min(k, len(ids)))
    return positions


def _byte_offsets(text: str, char_offsets: Sequence[int]) -> dict[int, int]:
    """{char offset: UTF-8 byte offset} for each offset, encoding each span of text once."""
    out: dict[int, int] = {}
    prev_char = prev_byte = 0
    for c in sorted(set(char_offsets)):
        prev_byte += len(text[prev_char:c].encode("utf-8"))
        prev_char = c
        out[c] = prev_byte
    return out
