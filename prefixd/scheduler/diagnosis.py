"""Cache diagnostics: why a prompt missed the cache, or where it left it.

Admission asks once per stream, after its lookup, and only when the lookup did not give the
whole prompt; what it answers goes into the stream's usage and never into what is served.
The reasons (`usage.cache_reason`, the `reason` label of prefixd_prefix_cache_misses_total):

| reason | when |
|---|---|
| `cache_off` | the request may not reuse: `cache: false`, the daemon's cache off, or a cache key of another length |
| `namespace_empty` | nothing is cached in the request's namespace |
| `evicted` | an earlier prompt of the namespace kept more of this prompt's rows than are held now (or the hit was let go to seat it) |
| `other_schedule` | identity-equal rows with a snapshot are held, but at no cut of this prompt's schedule with its hash (a family that is not row-invariant) |
| `too_short` | the prompt agrees with held rows, but fewer than the first resume point (a page, or the first cut) |
| `diverged` | the prompt leaves the held rows at `divergence.at`, below any resume point past the hit |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from prefixd.ipc.events import Divergence, Usage
from prefixd.scheduler.lanes import Lane, match_rows
from prefixd.scheduler.store import Hit, PrefixStore
from prefixd.scheduler.store.probe import AHEAD
from prefixd.scheduler.streams import Stream

CACHE_OFF = "cache_off"
NAMESPACE_EMPTY = "namespace_empty"
EVICTED = "evicted"
OTHER_SCHEDULE = "other_schedule"
TOO_SHORT = "too_short"
DIVERGED = "diverged"
BEFORE = 8  # prompt ids reported before the divergence
RECENT_REPORTS = 32  # finished streams' reports the engine keeps for `prefixd why`


@dataclass(frozen=True, slots=True)
class Diagnosis:
    reason: str | None = None
    divergence: Divergence | None = None


def full_hit(stream: Stream, hit: Hit | None) -> bool:
    """True when the hit leaves at most the prompt's last row to compute: nothing to explain."""
    return hit is not None and hit.rows >= stream.num_prompt - 1


def diagnose(stream: Stream, hit: Hit | None, store: PrefixStore, lanes: Sequence[Lane], *,
             invariant_rows: bool) -> Diagnosis:
    """Why `stream`'s lookup gave `hit` (None: a miss) and not more. Reads the store and the
    resident lanes; bounded work (the store's probe, one compare per resident lane)."""
    probe = store.probe(stream.key, stream.schedule)  # type: ignore[arg-type]
    tokens = stream.key_tokens
    rows, cached = (probe.match.rows, probe.match.cached) if probe.match is not None else (0, ())
    for lane in lanes:  # a resident lane may hold more of the prompt than the store (its reply)
        if lane.resident:
            k = match_rows(lane, tokens, stream.req.namespace, tuple(im.identity for im in stream.req.images))
            if k > rows:
                rows, cached = k, tuple(lane.ids[k:k + AHEAD])
    if probe.match is None and rows == 0:
        return Diagnosis(EVICTED if probe.kept_before > 0 else NAMESPACE_EMPTY)
    divergence = _divergence(tokens, rows, cached) if rows < len(tokens) else None
    got = hit.rows if hit is not None else 0
    if probe.kept_before > max(rows, got):
        return Diagnosis(EVICTED, divergence)
    if hit is not None:
        return Diagnosis(DIVERGED if divergence is not None else None, divergence)
    snapshot_cut = probe.match.snapshot_cut if probe.match is not None else 0
    if not invariant_rows and snapshot_cut > 0:
        return Diagnosis(OTHER_SCHEDULE, divergence)
    return Diagnosis(TOO_SHORT if rows > 0 else DIVERGED, divergence)


def _divergence(tokens: Sequence[int], at: int, cached: tuple[int, ...]) -> Divergence:
    return Divergence(at=at, new_id=tokens[at], cached_id=cached[0] if cached else None,
                      before_ids=tuple(tokens[max(0, at - BEFORE):at]), new_ids=tuple(tokens[at:at + AHEAD]),
                      cached_ids=cached)


def cache_report(stream_id: int, namespace: str, usage: Usage) -> dict:
    """A finished stream's cache report as the status reply's `cache_reports` lists it."""
    out: dict = {"stream_id": stream_id, "namespace": namespace, "cache": usage.cache,
                 "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens}
    if usage.cache_reason is not None:
        out["cache_reason"] = usage.cache_reason
    if usage.divergence is not None:
        out["divergence"] = usage.divergence.to_wire()
    return out
