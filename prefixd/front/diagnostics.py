"""Cache diagnostics on the front: the engine's token ids around a divergence, as text.

The engine reports where a prompt left the cache (`Usage.divergence`: a position and a few
ids each side, scheduler/diagnosis.py); the front, which has the tokenizer, adds the text:

    before_ids ... | new_ids[0]    new_ids[1:]      prompt:  "...the quick [cat] jumps"
                   | cached_ids[0] cached_ids[1:]   cached:  "...the quick [dog] sleeps"

`with_excerpt` fills `Divergence.excerpt` (the socket's done); `cache_report` is the map the
HTTP fronts put under `usage.prefixd.cache`; `excerpt_reports` fills the status reply's
`cache_reports` (what `prefixd why` prints).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from prefixd.ipc.events import Divergence, Usage


def excerpt(divergence: Divergence, tokenizer: Any) -> dict[str, str] | None:
    """The text of the divergence's ids (None: the tokenizer cannot decode)."""
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        return None

    def text(ids: Sequence[int]) -> str:
        return decode(list(ids)) if ids else ""

    return {"before": text(divergence.before_ids), "new_token": text(divergence.new_ids[:1]),
            "new_rest": text(divergence.new_ids[1:]), "cached_token": text(divergence.cached_ids[:1]),
            "cached_rest": text(divergence.cached_ids[1:])}


def with_excerpt(usage: Usage, tokenizer: Any) -> Usage:
    """`usage` with its divergence's excerpt filled (unchanged without a divergence)."""
    div = usage.divergence
    if div is None or div.excerpt is not None:
        return usage
    return dataclasses.replace(usage, divergence=dataclasses.replace(div, excerpt=excerpt(div, tokenizer)))


def cache_report(usage: Usage, tokenizer: Any) -> dict[str, Any]:
    """What the cache gave a request, for an HTTP front's `usage.prefixd.cache`:
    `{result, cached_tokens, prompt_tokens, reason?, divergence?}`, divergence as on the socket
    (docs/protocol.md, *generate*), its excerpt filled."""
    out: dict[str, Any] = {"result": usage.cache, "cached_tokens": usage.cached_tokens,
                           "prompt_tokens": usage.prompt_tokens}
    if usage.cache_reason is not None:
        out["reason"] = usage.cache_reason
    filled = with_excerpt(usage, tokenizer).divergence
    if filled is not None:
        out["divergence"] = filled.to_wire()
    return out


def excerpt_reports(status: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """`status` with the excerpt of every divergence in its `cache_reports` filled."""
    reports = status.get("cache_reports")
    if not isinstance(reports, (list, tuple)):
        return status
    filled = []
    for report in reports:
        div = report.get("divergence") if isinstance(report, dict) else None
        if isinstance(div, dict) and "excerpt" not in div:
            d = Divergence(at=div.get("at", 0), new_id=div.get("new_id", 0), cached_id=div.get("cached_id"),
                           before_ids=tuple(div.get("before_ids", ())), new_ids=tuple(div.get("new_ids", ())),
                           cached_ids=tuple(div.get("cached_ids", ())))
            report = {**report, "divergence": {**div, "excerpt": excerpt(d, tokenizer)}}
            if report["divergence"]["excerpt"] is None:
                del report["divergence"]["excerpt"]
        filled.append(report)
    return {**status, "cache_reports": filled}
