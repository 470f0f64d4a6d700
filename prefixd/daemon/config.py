"""`DaemonConfig`: the one frozen configuration of a running daemon, built once from flags + env.

Its fields, their defaults and the flags and variables they come from are the rows of
`prefixd.daemon.options.OPTIONS`; this module adds what is worked out from them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixd.daemon.options import DEFAULT_CPU_LANES, DEFAULT_CUDA_LANES, OPTIONS, Option, option, show_value

if TYPE_CHECKING:
    from prefixd.scheduler.config import SchedulerConfig

DEFAULT_DRAFT_MAX: int = option("--draft-max").default  # bench/draft.py runs with the daemon's
AUTO_CACHE_MAX_BYTES_CPU = 4 << 30  # host RAM is shared with everything else on the machine
# `--draft auto`: the drafter per (family, numeric mode) that bench/draft.py found to pay on
# the echo trace without slowing prose (docs/benchmarks.md, *Drafting*); unmeasured pairs: off.
AUTO_DRAFT = {
    ("llama", "int4"): "ngram",
    ("llama", "invariant"): "ngram",
}
# ... and for a model that ships MTP layers (a draft head), where bench/draft.py --mtp measured.
AUTO_DRAFT_HEAD: dict[tuple[str, str], str] = {}


class ConfigError(ValueError):
    """A flag or environment value that cannot be used; the message names it."""


class _Resolved:
    """What a DaemonConfig works out from its fields (the fields: one per row of OPTIONS)."""

    __slots__ = ()

    @property
    def num_lanes(self) -> int:
        if self.lanes is not None:
            return self.lanes
        return DEFAULT_CPU_LANES if self.device == "cpu" else DEFAULT_CUDA_LANES

    def resolved_socket_path(self) -> Path:
        if self.socket_path is not None:
            return self.socket_path
        from prefixd.ipc.paths import default_socket_path

        return default_socket_path()

    def resolved_max_context(self, model_max_context: int, lanes_fit: int | None = None) -> int:
        """--max-context, at most the model's; else the model's context, at most `lanes_fit`:
        the longest context whose KV every lane can hold in memory (runtime.lanes_fit_context;
        None where the memory is not known)."""
        if self.max_context is not None:
            return min(self.max_context, model_max_context)
        return model_max_context if lanes_fit is None else min(lanes_fit, model_max_context)

    def scheduler_config(self, *, max_context: int, draft: str) -> SchedulerConfig:
        """The scheduler's config for this daemon, given what the load resolved: the context
        (`resolved_max_context`) and the drafter (`resolve_draft`, never "auto")."""
        from prefixd.scheduler.config import SchedulerConfig

        return SchedulerConfig(num_lanes=self.num_lanes, grid=self.grid, max_context=max_context, cache=self.cache,
                               cache_budget_bytes=self.cache_budget_bytes, draft=draft, draft_max=self.draft_max)


DaemonConfig = dataclasses.make_dataclass(
    "DaemonConfig", [(o.field, o.annotation, dataclasses.field(default=o.default)) for o in OPTIONS],
    bases=(_Resolved,), frozen=True, slots=True,
    namespace={"__module__": __name__,
               "__doc__": "Everything `prefixd serve` was asked to do (fields: prefixd.daemon.options.OPTIONS). "
                          "Runtime values are never written back."})


def config_from_args(args: object, env: dict[str, str] | None = None) -> DaemonConfig:
    """Build the config from parsed `serve` flags; PREFIXD_* env fills what flags left unset.

    A value that cannot be parsed raises ConfigError naming the flag or the variable it came from.
    """
    env = dict(os.environ) if env is None else env
    return _check(DaemonConfig(**{o.field: _value(o, args, env) for o in OPTIONS}))


def _value(opt: Option, args: object, env: dict[str, str]) -> Any:
    """`opt`'s value: its flag's, else its variable's, else its default."""
    given = getattr(args, opt.dest, None)
    if opt.is_switch:
        if given:
            return not opt.default
        given = None
    value, where = given, opt.flag
    if value is None:
        if opt.env not in env:
            return opt.unset(env) if opt.unset is not None else opt.default
        value, where = env[opt.env], opt.env
    try:
        parsed = opt.parse(value)
        if opt.choices and parsed not in opt.choices:
            raise ValueError(f"expected one of {', '.join(opt.choices)}")
    except ValueError as e:
        expected = {int: "expected an integer", float: "expected a number"}.get(opt.parse, str(e))
        raise ConfigError(f"{where}={value!r}: {expected}") from None
    return opt.default if parsed is None else parsed


def _check(cfg: DaemonConfig) -> DaemonConfig:
    """Each option's own check, then the ones between options."""
    for opt in OPTIONS:
        value = getattr(cfg, opt.field)
        problem = None if value is None or opt.check is None else opt.check(value)
        if problem is not None:
            raise ConfigError(f"{opt.flag} {show_value(value)}: {problem}")
    if cfg.mode == "int4" and (cfg.device != "cpu" or cfg.dtype != "bf16"):
        raise ConfigError("--mode int4 runs on the CPU in bf16 only")
    if cfg.grid % cfg.page_size:
        raise ConfigError(f"--grid {cfg.grid} must be a multiple of --page-size {cfg.page_size}")
    if cfg.http_addr:
        from prefixd.front.http.addr import check_http_addr

        check_http_addr(cfg.http_addr, cfg.http_token_file)
    if cfg.metrics_addr:
        from prefixd.metrics.exporter import MetricsAddrError, parse_metrics_addr

        try:
            parse_metrics_addr(cfg.metrics_addr)
        except MetricsAddrError as e:
            raise ConfigError(str(e)) from None
    return cfg


def resolve_draft(draft: str, family: str, mode: str, draft_head: bool = False) -> str:
    """`draft` itself, or for "auto" the drafter `AUTO_DRAFT` names for the loaded model's
    family and numeric mode ("off" where none was measured to pay); for a model with MTP
    layers (`draft_head`), `AUTO_DRAFT_HEAD` first."""
    if draft != "auto":
        return draft
    if draft_head and (family, mode) in AUTO_DRAFT_HEAD:
        return AUTO_DRAFT_HEAD[family, mode]
    return AUTO_DRAFT.get((family, mode), "off")



def cache_budget_warning(info: Any, sched: Any) -> str | None:
    """The start-up warning for an explicit cache budget that leaves the prefix store less
    than one page (scheduler.config.store_budget_bytes reserves weights, lane state and
    workspace out of the budget first), or None. `info`: the DeviceInfo; `sched`: the
    SchedulerConfig the engine runs with."""
    from prefixd.scheduler.config import store_budget_bytes

    budget = sched.cache_budget_bytes
    if budget is None or not sched.cache:
        return None
    allowance = store_budget_bytes(info, sched)
    if allowance >= info.kv_bytes_per_page:
        return None
    unbounded = 1 << 62
    reserved = unbounded - store_budget_bytes(info, dataclasses.replace(sched, cache_budget_bytes=unbounded))
    return (f"--cache-budget {budget} bytes leaves the prefix cache {allowance} bytes (less than one "
            f"{info.kv_bytes_per_page}-byte page): weights, lane state and workspace take {reserved} bytes of the "
            f"budget first; give at least {reserved + info.kv_bytes_per_page} bytes, or auto, to cache prefixes")
