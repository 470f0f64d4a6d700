"""Chat templates: sandboxed jinja2 rendering and the token position of each message.

Templates come from GGUF `tokenizer.chat_template`, an HF dir's `chat_template.jinja`, or
`tokenizer_config.json` "chat_template" (a string, or a list of {"name", "template"}).
They run in `jinja2.sandbox.ImmutableSandboxedEnvironment` with the helpers templates in the
wild expect: `raise_exception`, a `tojson` filter that does not HTML-escape, `strftime_now`.

Message starts (where each message begins, in tokens of the full render):

1. render the whole conversation -> text, tokenize -> ids;
2. for message i, render messages[:i] (no generation prompt); its start is the length of
   the common prefix of that render and the full text, in characters. For templates that
   render a prefix exactly as the full conversation begins (the usual case) this is the
   prefix render's length; for templates that render the tail differently (e.g. the last
   message), it is where the two renders first differ, which still lies on text that the
   next turn renders identically. The generation prompt's start is computed the same way
   from render(messages, add_generation_prompt=False);
3. map each character offset to a token position through the ids' byte offsets: the token
   that starts exactly there when the tokenization splits cleanly at it (then the position
   equals the token length of the text before it), else the token that straddles it.
   A prefix the template refuses to render repeats the previous start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from prefixd.gpu.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The template is missing or broken, or it rejects the conversation (client input)."""


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation: its ids, the token position where each message starts
    (plus the generation prompt's start when one was added), and the rendered text."""

    ids: tuple[int, ...]
    message_starts: tuple[int, ...]
    text: str


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes <, >, & and '; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled template; `specials` (bos_token, eos_token, ...) are passed to every render."""

    def __init__(self, source: str, specials: Mapping[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template syntax error (line {exc.lineno}): {exc.message}") from exc
        self.source = source
        self._specials = dict(specials or {})

    def render(self, messages: list[dict], *, add_generation_prompt: bool, tools: list | None = None,
               **kwargs: Any) -> str:
        """The template's text for `messages`; ChatTemplateError if the template rejects them."""
        context = {**self._specials, **kwargs, "messages": messages, "tools": tools,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc!r}") from exc


def load_hf_templates(root: Path, tok_cfg: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    """(default template, named templates) of an HF dir: chat_template.jinja wins over
    chat_template.json, which wins over tokenizer_config.json's "chat_template"."""
    named: dict[str, str] = {}
    raw: Any = tok_cfg.get("chat_template")
    json_file = root / "chat_template.json"
    if json_file.is_file():
        try:
            raw = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template", raw)
        except (OSError, ValueError, AttributeError) as exc:
            raise ChatTemplateError(f"{json_file}: cannot parse: {exc}") from exc
    if isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str):
                named[entry["name"]] = entry["template"]
        raw = named.get("default")
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        raw = jinja_file.read_text(encoding="utf-8")
    default = raw if isinstance(raw, str) else None
    if default is not None:
        named["default"] = default
    return default, named


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _char_starts(template: ChatTemplate, messages: list[dict], text: str, *, add_generation_prompt: bool,
                 tools: list | None, kwargs: Mapping[str, Any]) -> list[int]:
    cuts = list(range(len(messages))) + ([len(messages)] if add_generation_prompt else [])
    starts: list[int] = []
    for i in cuts:
        try:
            prefix = template.render(messages[:i], add_generation_prompt=False, tools=tools, **kwargs)
            starts.append(_common_prefix_len(prefix, text))
        except ChatTemplateError:
            starts.append(starts[-1] if starts else 0)
    return starts


def _token_positions(tokenizer: Tokenizer, text: str, ids: list[int], char_starts: list[int]) -> list[int]:
    """Map character offsets to token positions (floor to the token covering the offset)."""
    bounds = tokenizer.offsets_bytes(ids)
    if bounds[-1] == len(text.encode("utf-8")):
        targets = [len(text[:c].encode("utf-8")) for c in char_starts]
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


def render_conversation(template: ChatTemplate, messages: list[dict], tokenizer: Tokenizer, *,
                        add_generation_prompt: bool = True, tools: list | None = None,
                        **kwargs: Any) -> RenderedChat:
    """Render, tokenize and locate message starts (see the module docstring for the method)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of maps")
    text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
    ids = tokenizer.encode(text)
    chars = _char_starts(template, messages, text, add_generation_prompt=add_generation_prompt, tools=tools,
                         kwargs=kwargs)
    starts = _token_positions(tokenizer, text, ids, chars)
    return RenderedChat(ids=tuple(ids), message_starts=tuple(starts), text=text)
