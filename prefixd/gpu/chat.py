"""Chat templates: sandboxed jinja2 rendering and the token position of each message.

Templates come from GGUF `tokenizer.chat_template`, an HF dir's `chat_template.jinja`, or
`tokenizer_config.json` "chat_template" (a string, or a list of {"name", "template"}).
They run in `jinja2.sandbox.ImmutableSandboxedEnvironment` with the helpers templates in the
wild expect: `raise_exception`, a `tojson` filter that does not HTML-escape, `strftime_now`.

Message starts are defined by prefix renders (chat_starts.py computes them in linear time):
message i starts where render(messages[:i]) and the full render first differ, in
characters (for the usual template, the prefix render's length), mapped to the token that
starts there or straddles it; the generation prompt's start is computed the same way from
render(messages, add_generation_prompt=False). A prefix the template refuses repeats the
previous start.

Work is bounded before it starts (MAX_CHAT_MESSAGES, MAX_CHAT_CHARS) and a caller's
`should_stop` is polled between messages, so a render whose client left ends early.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import jinja2
from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prefixd.ipc.messages import MAX_CHAT_MESSAGES  # the protocol's bound, checked again here

if TYPE_CHECKING:
    from prefixd.gpu.tokenizer import Tokenizer

MAX_CHAT_CHARS = 4 << 20  # characters in all of a conversation's strings together
MARK_NAME = "prefixd_mark__"  # the callable the instrumented template calls per loop item


class ChatTemplateError(ValueError):
    """The template is missing or broken, or it rejects the conversation (client input)."""


class ChatTooLarge(ChatTemplateError):
    """The conversation is over MAX_CHAT_MESSAGES or MAX_CHAT_CHARS (checked before rendering)."""


class RenderCancelled(Exception):
    """`should_stop` said the caller no longer wants this render (its client left)."""


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
        self._marked = _instrumented(env, source)
        self.source = source
        self._specials = dict(specials or {})

    @property
    def can_mark(self) -> bool:
        """Whether the template has a loop to mark messages in (see `render(mark=...)`)."""
        return self._marked is not None

    def render(self, messages: list[dict], *, add_generation_prompt: bool, tools: list | None = None,
               mark: Callable[[Any], str] | None = None, **kwargs: Any) -> str:
        """The template's text for `messages`; ChatTemplateError if the template rejects them.

        With `mark`, the instrumented twin runs: every `for x in ...` loop body first emits
        mark(x) (a message's marker, or "" for anything else; it may raise to stop the render).
        """
        context = {**self._specials, **kwargs, "messages": messages, "tools": tools,
                   "add_generation_prompt": add_generation_prompt}
        template = self._template
        if mark is not None:
            if self._marked is None:
                raise ValueError("render(mark=...) on a template without a loop (check can_mark)")
            template, context[MARK_NAME] = self._marked, mark
        try:
            return template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc!r}") from exc


def _instrumented(env: jinja2.Environment, source: str) -> jinja2.Template | None:
    """The template with `{{ prefixd_mark__(x) }}` first in the body of every `for x in` loop,
    or None when it has no such loop. Output is unchanged while the mark returns ""."""
    try:
        ast = env.parse(source)
    except jinja2.TemplateError:
        return None
    found = False
    for loop in ast.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name):
            call = nodes.Call(nodes.Name(MARK_NAME, "load"), [nodes.Name(loop.target.name, "load")], [], None, None)
            output = nodes.Output([call])
            output.set_lineno(loop.lineno)
            loop.body.insert(0, output)
            found = True
    if not found:
        return None
    try:
        return env.from_string(ast)
    except (jinja2.TemplateError, SyntaxError, TypeError, ValueError):
        return None  # starts then come from prefix renders alone (see chat_starts.py)


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




def check_chat_size(messages: list[dict]) -> None:
    """ChatTooLarge when `messages` exceed MAX_CHAT_MESSAGES or MAX_CHAT_CHARS (cheap: one walk)."""
    if len(messages) > MAX_CHAT_MESSAGES:
        raise ChatTooLarge(f"{len(messages)} messages; a conversation may hold at most {MAX_CHAT_MESSAGES}")
    total = 0
    pending: list[Any] = list(messages)
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, Mapping):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        if total > MAX_CHAT_CHARS:
            raise ChatTooLarge(f"the messages hold over {MAX_CHAT_CHARS} characters; "
                               f"a conversation may hold at most {MAX_CHAT_CHARS}")


def render_conversation(template: ChatTemplate, messages: list[dict], tokenizer: Tokenizer, *,
                        add_generation_prompt: bool = True, tools: list | None = None,
                        should_stop: Callable[[], bool] | None = None, **kwargs: Any) -> RenderedChat:
    """Render, tokenize and locate message starts (see the module docstring for the definition).

    Raises ChatTooLarge before any rendering when the conversation is over the limits,
    ChatTemplateError when the template rejects it, RenderCancelled when `should_stop()`
    turns true (polled between messages).
    """
    from prefixd.gpu.chat_starts import StartFinder, token_positions

    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of maps")
    check_chat_size(messages)
    finder = StartFinder(template, messages, tools=tools, kwargs=kwargs, should_stop=should_stop,
                         nonce=secrets.token_hex(8))
    # The text (and so the ids) comes from the template as written, not its instrumented twin.
    text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
    finder.poll()
    chars = finder.char_starts(text, add_generation_prompt=add_generation_prompt)
    finder.poll()
    ids = tokenizer.encode(text)
    starts = token_positions(tokenizer, text, ids, chars)
    return RenderedChat(ids=tuple(ids), message_starts=tuple(starts), text=text)
