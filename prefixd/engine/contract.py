"""The contract between the front process and the engine process (version `VERSION`).

One socket (a socketpair made by the front) carries frames of `prefixd.ipc.framing`: a
4-byte length and one msgpack map, with large binary fields (image rows, the tokenizer) as
sealed memfds passed with SCM_RIGHTS (`prefixd.ipc.memfd`). Every map has a `t` key:

    front -> engine                              engine -> front
    ---------------                              ---------------
    start   {spec}        (first frame)          ready   {version, model_info, tokenizer, warnings}
    submit  {request}                            failed  {message, startup}   (then it exits)
                                                 accepted {id} | refused {id, code, message}
    cancel  {id, keep}
    status  {q, check}                           status  {q, status, idle}
    stop    {}            (flush, then exit)     round   {events, observed, pages}   one per round

The records are the scheduler's own types (`StreamRequest` in; `TokenEvent`, `DoneEvent`,
`Usage` with its `Divergence`, `TokenLogprob` out): `encode` and `decode` below are their wire form and know no
others, so nothing else can cross. `observed` lists the `EngineObserver` calls of the round
(name and arguments) for the front's metrics; `pages` is the KV pool's (free, used).

The start spec (which factory builds the runtime, the daemon's config) and the tokenizer
are pickled: both ends are the same installation, started by the front, never a client.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from prefixd.ipc.framing import Limits
from prefixd.ipc.events import Divergence
from prefixd.scheduler.records import ImageIdentity, ImageRows, SamplingParams, TokenLogprob
from prefixd.scheduler.streams import DoneEvent, StreamRequest, TokenEvent, Usage

VERSION = 1

# The link is between two processes of one installation: its limits bound bugs, not attacks.
LINK_LIMITS = Limits(max_frame_bytes=1 << 30, max_str_bytes=1 << 28, max_bin_bytes=1 << 28,
                     max_array_len=1 << 26, max_map_len=1 << 16, max_depth=32, max_fds_per_frame=64,
                     max_memfd_bytes=1 << 34, max_payload_bytes=1 << 36, memfd_threshold_bytes=64 << 10)

# What a refused submit says (`RequestError.code`); each is an `ErrorCode` of the protocol.
RefusalCode = Literal["invalid_token", "context_overflow", "bad_request"]
REFUSAL_CODES: tuple[str, ...] = ("invalid_token", "context_overflow", "bad_request")

# The EngineObserver calls that cross (prefixd.scheduler.events), replayed by the front.
OBSERVED = frozenset({"on_round", "on_admit", "on_first_token", "on_token_gap", "on_done", "on_lookup",
                      "on_miss", "on_eviction", "on_snapshot_copy", "on_store", "on_disk", "on_draft"})


class ContractError(ValueError):
    """A frame of the link that is not this version's contract (a bug on one side)."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the engine process builds: `factory(config, observer) -> Runtime`, named
    "module:attribute" (called with `factory_args` first, when given, to make the factory)."""

    factory: str
    config: Any  # prefixd.daemon.config.DaemonConfig
    factory_args: dict[str, Any] | None = None
    sys_path: tuple[str, ...] = ()  # prepended in the child, so a test's factory module imports
    log_level: str = "info"


def pack_object(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_object(data: bytes) -> Any:
    return pickle.loads(data)  # noqa: S301 - written by this installation's other process


# -- records -----------------------------------------------------------------------------------

_RECORDS: dict[str, type] = {cls.__name__: cls for cls in (
    StreamRequest, SamplingParams, ImageRows, ImageIdentity, TokenEvent, DoneEvent, Usage, Divergence,
    TokenLogprob)}


def encode(value: Any) -> Any:
    """`value` as msgpack-ready data: a contract record becomes {"@": its name, field: ...}."""
    kind = type(value)
    if kind in (int, float, str, bool, bytes) or value is None:
        return value
    if kind in (tuple, list):
        return [encode(v) for v in value]
    if kind is frozenset:
        return {"@": "frozenset", "v": sorted(value)}
    if kind is dict:
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return {"@": "ndarray", "dtype": data.dtype.str, "shape": list(data.shape), "data": memoryview(data).cast("B")}
    if isinstance(value, memoryview):
        return encode(np.asarray(value))
    name = kind.__name__
    if _RECORDS.get(name) is not kind:
        raise ContractError(f"{name} does not cross the engine contract")
    out: dict[str, Any] = {"@": name}
    for f in dataclasses.fields(value):
        out[f.name] = encode(getattr(value, f.name))
    return out


def decode(data: Any) -> Any:
    """The inverse of `encode` (lists come back as tuples, as the records hold them)."""
    if isinstance(data, list):
        return tuple(decode(v) for v in data)
    if not isinstance(data, dict):
        return data
    name = data.get("@")
    if name is None:
        return {k: decode(v) for k, v in data.items()}
    if name == "frozenset":
        return frozenset(data["v"])
    if name == "ndarray":
        raw = data["data"]
        return np.frombuffer(bytes(raw) if not isinstance(raw, bytes) else raw,
                             dtype=np.dtype(data["dtype"])).reshape(data["shape"]).copy()
    cls = _RECORDS.get(name)
    if cls is None:
        raise ContractError(f"unknown record {name!r}")
    try:
        return cls(**{k: decode(v) for k, v in data.items() if k != "@"})
    except TypeError as e:
        raise ContractError(f"{name}: {e}") from None


def message(kind: str, **fields: Any) -> dict[str, Any]:
    return {"t": kind, **fields}
