"""The `prefixd` fields of every HTTP API, built in one place for all of them.

A request may carry `"prefixd": {"logits": true, "draft": "off"}` beside its API's own fields
(Chat Completions, Completions, Messages, Responses): `logits` asks for each generated token's
id and the sha256 of its float32 logits row (the socket's `logits: true`), `draft` is the
socket's `draft` (`auto` or `off`). Any other key is a 400: a misspelt switch must not be
silently ignored by a test that relies on it.

Every reply's usage carries `prefixd`:

    cache          what the cache gave: result, cached_tokens, prompt_tokens, and on a miss
                   or a partial hit the reason or the divergence (front/diagnostics.py)
    normalised     the prompt hygiene rules that changed the request (when one did)
    ids, logits_sha256   the generated ids and their digests (when `prefixd.logits` asked)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixd.front.diagnostics import cache_report
from prefixd.ipc.events import DoneEvent, TokenEvent

FIELD = "prefixd"
_DRAFT = ("auto", "off")


def request_fields(body: dict[str, Any], error: Any) -> dict[str, Any]:
    """What a body's `prefixd` field adds to its generate map; `error(message, param)` makes
    the API's 400."""
    raw = body.get(FIELD)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise error(f"{FIELD}: must be an object", FIELD)
    unknown = sorted(set(raw) - {"logits", "draft"})
    if unknown:
        raise error(f"{FIELD}.{unknown[0]}: unknown (known: logits, draft)", FIELD)
    out: dict[str, Any] = {}
    if "logits" in raw:
        if not isinstance(raw["logits"], bool):
            raise error(f"{FIELD}.logits: must be true or false", FIELD)
        if raw["logits"]:
            out["logits"] = True
    if "draft" in raw:
        if raw["draft"] not in _DRAFT:
            raise error(f"{FIELD}.draft: must be one of {', '.join(_DRAFT)}", FIELD)
        out["draft"] = raw["draft"]
    return out


@dataclass
class UsageExtension:
    """usage.prefixd of one request, gathered as its events arrive."""

    tokenizer: Any
    normalised: tuple[str, ...] = ()
    bits: bool = False  # the request asked for ids and logits digests
    ids: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, generate: dict[str, Any], normalised: tuple[str, ...], tokenizer: Any) -> UsageExtension:
        return cls(tokenizer, normalised, bool(generate.get("logits")))

    def add(self, event: TokenEvent) -> None:
        if self.bits:
            self.ids.extend(event.ids)
            self.digests.extend(event.logits_sha256 or ())

    def usage(self, done: DoneEvent | None) -> dict[str, Any]:
        """The map (empty before `done` when nothing was normalised)."""
        out: dict[str, Any] = {}
        if done is not None:
            out["cache"] = cache_report(done.usage, self.tokenizer)
        if self.normalised:
            out["normalised"] = list(self.normalised)
        if self.bits and done is not None:
            out["ids"] = list(self.ids)
            out["logits_sha256"] = list(self.digests)
        return out
