"""Constrained output: `response_format` -> an llguidance grammar, checked against the
model's tokenizer before a request starts (no torch here; gpu/constrain.py applies it).

llguidance is chosen over xgrammar and outlines-core: it computes each token mask lazily
from the tokenizer's token bytes (tens of microseconds per token on this CPU, no vocabulary-
wide precompilation per schema, so a new schema costs no start-up), it is the engine behind
llama.cpp's and vLLM's guidance backends and keeps JSON Schema coverage wide (and says when a
schema is unsatisfiable instead of hanging), and it ships abi3 wheels with no torch or CUDA
dependency, kept by an active upstream.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
_ANY_JSON_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """The response_format cannot be used (the library's message says why)."""


def grammar_of(response_format: dict[str, Any] | None) -> str | None:
    """The llguidance grammar (JSON text) of a checked `response_format` map; None for text."""
    import llguidance

    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    matcher = llguidance.LLMatcher
    if kind == "json_object":
        return matcher.grammar_from_json_schema(_ANY_JSON_OBJECT, defaults=_json_options())
    if kind == "json_schema":
        schema = response_format["json_schema"].get("schema", _ANY_JSON_OBJECT)  # type: ignore[index]
        try:
            return matcher.grammar_from_json_schema(schema, defaults=_json_options())
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
    if kind == "regex":
        return matcher.grammar_from_regex(response_format["regex"])  # type: ignore[index]
    if kind == "grammar":
        return matcher.grammar_from_lark(response_format["grammar"])  # type: ignore[index]
    raise GrammarError(f"type: {kind!r} is not one of {', '.join(FORMATS)}")


def _json_options() -> dict[str, Any]:
    # Compact separators: the shortest token paths, and what a model's own JSON looks like.
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarChecker:
    """Validates grammars against one tokenizer. Its llguidance tokenizer is `ll_tokenizer`'s
    shared one, so a checker per connection costs nothing after the first."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ll: Any = None

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll is None:
            self._ll = ll_tokenizer(self._tokenizer)
        return self._ll

    def check(self, grammar: str) -> None:
        """Raise GrammarError when the grammar is invalid or unsatisfiable."""
        import llguidance

        message = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if message:
            raise GrammarError(message.strip().splitlines()[0] if message.strip() else message)


class _Spelling:
    """What llguidance's TokenizerWrapper reads from a tokenizer without a `tokenizers` backend."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) or b"\xff<%d>" % i for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if not tokenizer.token_bytes(i)]

    def __call__(self, text: bytes | str) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


_shared: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any) -> Any:
    """The llguidance tokenizer over the model's, built once per tokenizer object and shared
    by every caller (the runner, each connection's checker): a build takes ~0.2-1 s of CPU for
    a 49k vocabulary with the GIL held, so one per request stalls the event loop and the
    engine thread. Read-only once built, so threads share it."""
    with _shared_lock:  # concurrent first requests build it once
        try:
            return _shared[tokenizer]
        except KeyError:
            pass
        except TypeError:  # an object without weak references: built for this caller only
            return _build_ll_tokenizer(tokenizer)
        built = _shared[tokenizer] = _build_ll_tokenizer(tokenizer)
        return built


def _build_ll_tokenizer(tokenizer: Any) -> Any:
    """An llguidance tokenizer over the model's: its own `tokenizers` JSON when it has one,
    else its token bytes. The model's stop ids are the grammar's end tokens."""
    import llguidance

    eos = sorted(tokenizer.stop_ids) or None
    backend_json = getattr(tokenizer, "backend_json", None)
    if backend_json is not None:
        return llguidance.LLTokenizer(backend_json(), n_vocab=tokenizer.vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Spelling(tokenizer)), eos_token=eos)


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None, *, native: bool) -> str:
    """A grammar forcing a tool call (tool_choice `required`, or the function `name`), in the
    syntax prefixd.text.tools parses: one JSON object per block for templates that know
    tools, a JSON array of calls for the rest."""
    import llguidance

    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    one_call = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False,
    } for f in functions]}
    if native:
        body, open_, close = one_call, "<tool_call>\\n", "\\n</tool_call>"
    else:
        body, open_, close = {"type": "array", "minItems": 1, "items": one_call}, "<tool_call>", "</tool_call>"
    lark = f'start: "{open_}" call "{close}"\ncall: %json {json.dumps({**body, "x-guidance": _json_options()})}'
    return llguidance.LLMatcher.grammar_from_lark(lark)
