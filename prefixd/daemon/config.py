"""`DaemonConfig`: the one frozen configuration of a running daemon, built once from flags + env."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

DEFAULT_METRICS_ADDR = "127.0.0.1:9464"
DEFAULT_CPU_LANES = 8
DEFAULT_CUDA_LANES = 16
DEFAULT_PAGE_SIZE = 16
DEFAULT_GRID = 256
DEFAULT_GRACE_S = 10.0
# Most drafts a lane verifies a round: 7, so its verify rows (its last token and 7 drafts) are
# one task of mode int4's attention (8 rows) and one rows-bucket of the decode programs (8);
# the round's policy grants fewer where rows cost more than they return (docs/benchmarks.md,
# *Drafting*: 1-lane echo 2.82x against 2.64x with 4, 8 lanes alike).
DEFAULT_DRAFT_MAX = 7
# Without --max-context a CPU daemon caps the context: each lane's KV is reserved up front.
DEFAULT_CPU_MAX_CONTEXT = 4096
# `--cache-budget auto`: this share of the memory left after weights, lanes and workspace.
AUTO_CACHE_FRACTION = 0.5
AUTO_CACHE_MAX_BYTES_CPU = 4 << 30  # host RAM is shared with everything else on the machine
LOG_LEVELS = ("debug", "info", "warning", "error")
# numeric modes (prefixd.gpu.model.MODES); "auto" is resolved by prefixd.gpu.families.resolve_mode
MODES = ("auto", "invariant", "int4")
DRAFTS = ("auto", "mtp", "ngram", "off")
CUDA_GRAPHS = ("auto", "eager", "off")
OVERLAP = ("auto", "on", "off")
# `--draft auto`: the drafter per (family, numeric mode) that bench/draft.py found to pay on
# the echo trace without slowing prose (docs/benchmarks.md, *Drafting*); unmeasured pairs: off.
AUTO_DRAFT = {
    ("llama", "int4"): "ngram",
    ("llama", "invariant"): "ngram",
}
# ... and for a model that ships MTP layers (a draft head), where bench/draft.py --mtp measured.
AUTO_DRAFT_HEAD: dict[tuple[str, str], str] = {}
DEFAULT_DISK_BUDGET_BYTES = 8 << 30
# One client's frame budget (prefixd/front/pacing.py): far above what a normal client sends.
DEFAULT_CLIENT_FRAME_RATE = 500.0
DEFAULT_CLIENT_FRAME_BURST = 4096
DEFAULT_ERROR_FRAME_COST = 16
DEFAULT_CONNECT_FRAME_COST = 64
# Holds for a client that keeps abandoning generates (prefixd/front/abandon.py).
DEFAULT_ABANDON_GRACE = 6
DEFAULT_ABANDON_HOLD_MAX_S = 30.0

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


class ConfigError(ValueError):
    """A flag or environment value that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything `prefixd serve` was asked to do. Runtime values are never written back."""

    model: str = "default"  # "default" | FILE.gguf | HF_DIR
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    dtype: str = "bf16"  # "bf16" | "fp32"
    lanes: int | None = None  # None: DEFAULT_CPU_LANES / DEFAULT_CUDA_LANES
    socket_path: Path | None = None  # None: prefixd.ipc.paths.default_socket_path()
    allow_group: str | None = None
    metrics_addr: str = DEFAULT_METRICS_ADDR  # "" disables the exporter
    grace_s: float = DEFAULT_GRACE_S
    cache: bool = True
    cache_budget_bytes: int | None = None  # None: auto
    page_size: int = DEFAULT_PAGE_SIZE
    grid: int = DEFAULT_GRID
    max_context: int | None = None  # None: the model's, capped on CPU
    log_level: str = "info"
    mode: str = "auto"  # "auto" | "invariant" (weights in dtype) | "int4" (4-bit weights, CPU bf16)
    http_addr: str = ""  # "HOST:PORT" serves the OpenAI-compatible HTTP front; "" does not
    http_token_file: Path | None = None  # a bearer token clients must send; needed off loopback
    disk_cache_dir: Path | None = None  # None: no disk tier (config_from_args fills the default)
    disk_budget_bytes: int = DEFAULT_DISK_BUDGET_BYTES
    idle_exit_s: float | None = None  # None: never exit for idleness
    draft: str = "auto"  # "auto" | "mtp" | "ngram" | "off" (auto: `resolve_draft` once the model is loaded)
    draft_max: int = DEFAULT_DRAFT_MAX
    cuda_graphs: str = "auto"  # "auto": decode rounds as captured programs on CUDA (gpu/programs.py); "eager"; "off"
    overlap: str = "auto"  # "auto" (on for CUDA) | "on" | "off": the next round's host work beside the device call
    client_frame_rate: float = DEFAULT_CLIENT_FRAME_RATE  # frames a second one client is read at; 0: unpaced
    client_frame_burst: int = DEFAULT_CLIENT_FRAME_BURST
    error_frame_cost: int = DEFAULT_ERROR_FRAME_COST
    connect_frame_cost: int = DEFAULT_CONNECT_FRAME_COST
    abandon_grace: int = DEFAULT_ABANDON_GRACE  # abandoned generates a client may have before it is held
    abandon_hold_max_s: float = DEFAULT_ABANDON_HOLD_MAX_S  # the longest hold; 0: never held

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

    def resolved_max_context(self, model_max_context: int) -> int:
        if self.max_context is not None:
            return min(self.max_context, model_max_context)
        if self.device == "cpu":
            return min(DEFAULT_CPU_MAX_CONTEXT, model_max_context)
        return model_max_context


def parse_size(text: str) -> int | None:
    """"auto" -> None; "4GiB", "512M", "1000000" -> bytes (k/M/G decimal, Ki/Mi/Gi binary)."""
    if text.strip().lower() == "auto":
        return None
    m = _SIZE_RE.match(text)
    if m is None:
        raise ConfigError(f"cache budget {text!r}: expected BYTES (e.g. 4GiB, 512M) or auto")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _UNITS[unit])


def default_disk_cache_dir(env: dict[str, str]) -> Path:
    """$STATE_DIRECTORY (systemd's StateDirectory=, the first if several), else
    $XDG_CACHE_HOME/prefixd, else ~/.cache/prefixd."""
    state = env.get("STATE_DIRECTORY", "").split(":")[0]
    if state:
        return Path(state)
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg else Path(env.get("HOME") or Path.home()) / ".cache"
    return base / "prefixd"


def _check(cfg: DaemonConfig) -> DaemonConfig:
    if cfg.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", cfg.device):
        raise ConfigError(f"--device {cfg.device!r}: expected cpu or cuda[:N]")
    if cfg.dtype not in ("bf16", "fp32"):
        raise ConfigError(f"--dtype {cfg.dtype!r}: expected bf16 or fp32")
    if cfg.mode not in MODES:
        raise ConfigError(f"--mode {cfg.mode!r}: expected one of {', '.join(MODES)}")
    if cfg.mode == "int4" and (cfg.device != "cpu" or cfg.dtype != "bf16"):
        raise ConfigError("--mode int4 runs on the CPU in bf16 only")
    if cfg.lanes is not None and cfg.lanes < 1:
        raise ConfigError(f"--lanes {cfg.lanes}: needs at least 1")
    if cfg.page_size < 1 or cfg.grid < 1 or cfg.grid % cfg.page_size:
        raise ConfigError(f"--grid {cfg.grid} must be a positive multiple of --page-size {cfg.page_size}")
    if cfg.draft not in DRAFTS:
        raise ConfigError(f"--draft {cfg.draft!r}: expected one of {', '.join(DRAFTS)}")
    if cfg.draft_max < 0:
        raise ConfigError(f"--draft-max {cfg.draft_max}: must be >= 0")
    if cfg.grace_s < 0:
        raise ConfigError(f"--grace {cfg.grace_s}: must be >= 0")
    if cfg.max_context is not None and cfg.max_context < 2:
        raise ConfigError(f"--max-context {cfg.max_context}: must be >= 2")
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(f"log level {cfg.log_level!r}: expected one of {', '.join(LOG_LEVELS)}")
    if cfg.http_addr:
        from prefixd.front.http.addr import check_http_addr

        check_http_addr(cfg.http_addr, cfg.http_token_file)
    if cfg.disk_budget_bytes < 0:
        raise ConfigError(f"--disk-budget {cfg.disk_budget_bytes}: must be >= 0")
    if cfg.idle_exit_s is not None and cfg.idle_exit_s <= 0:
        raise ConfigError(f"--idle-exit {cfg.idle_exit_s:g}: must be > 0 seconds")
    if cfg.client_frame_rate < 0 or cfg.client_frame_burst < 1:
        raise ConfigError(f"--client-frame-rate {cfg.client_frame_rate:g} must be >= 0 (0: unpaced) and "
                          f"--client-frame-burst {cfg.client_frame_burst} >= 1")
    if cfg.error_frame_cost < 1 or cfg.connect_frame_cost < 0:
        raise ConfigError(f"--error-frame-cost {cfg.error_frame_cost} must be >= 1 and "
                          f"--connect-frame-cost {cfg.connect_frame_cost} >= 0")
    if cfg.abandon_grace < 0 or not 0 <= cfg.abandon_hold_max_s < float("inf"):
        raise ConfigError(f"--abandon-grace {cfg.abandon_grace} must be >= 0 and "
                          f"--abandon-hold-max {cfg.abandon_hold_max_s:g} a number of seconds >= 0 (0: never held)")
    if cfg.metrics_addr:
        from prefixd.metrics.exporter import MetricsAddrError, parse_metrics_addr

        try:
            parse_metrics_addr(cfg.metrics_addr)
        except MetricsAddrError as e:
            raise ConfigError(str(e)) from None
    return cfg


def _opt_path(value: object) -> Path | None:
    return None if value in (None, "") else Path(str(value))


def config_from_args(args: object, env: dict[str, str] | None = None) -> DaemonConfig:
    """Build the config from parsed `serve` flags; PREFIXD_* env fills what flags left unset.

    A value that cannot be parsed raises ConfigError naming the flag or the variable it came from.
    """
    env = dict(os.environ) if env is None else env

    def pick(name: str, env_name: str, default: object, parse: Callable[[str], Any] = str) -> Any:
        value = getattr(args, name, None)
        where = f"--{name.replace('_', '-')}"
        if value is None:
            if env_name not in env:
                return default
            value, where = env[env_name], env_name
        try:
            return parse(value)
        except ValueError as e:
            expected = {int: "expected an integer", float: "expected a number"}.get(parse, str(e))
            raise ConfigError(f"{where}={value!r}: {expected}") from None

    socket_text = pick("socket", "PREFIXD_SOCKET", None)
    cache_budget_bytes = pick("cache_budget", "PREFIXD_CACHE_BUDGET", None, _size_or_auto)
    disk_dir = pick("disk_cache", "PREFIXD_DISK_CACHE", None)
    disk_budget = pick("disk_budget", "PREFIXD_DISK_BUDGET", None, _size_or_auto)
    cfg = DaemonConfig(
        model=pick("model", "PREFIXD_MODEL", "default"),
        device=pick("device", "PREFIXD_DEVICE", "cpu", _device),
        dtype=pick("dtype", "PREFIXD_DTYPE", "bf16", _one_of("bf16", "fp32")),
        lanes=pick("lanes", "PREFIXD_LANES", None, int),
        socket_path=None if socket_text in (None, "") else Path(str(socket_text)),
        allow_group=pick("allow_group", "PREFIXD_ALLOW_GROUP", None) or None,
        metrics_addr=pick("metrics_addr", "PREFIXD_METRICS_ADDR", DEFAULT_METRICS_ADDR),
        grace_s=pick("grace", "PREFIXD_GRACE_S", DEFAULT_GRACE_S, float),
        cache=not bool(getattr(args, "no_cache", False)) and _env_flag(env, "PREFIXD_CACHE"),
        cache_budget_bytes=cache_budget_bytes,
        page_size=pick("page_size", "PREFIXD_PAGE_SIZE", DEFAULT_PAGE_SIZE, int),
        grid=pick("grid", "PREFIXD_GRID", DEFAULT_GRID, int),
        max_context=pick("max_context", "PREFIXD_MAX_CONTEXT", None, int),
        log_level=pick("log_level", "PREFIXD_LOG_LEVEL", "info", _one_of(*LOG_LEVELS)),
        mode=pick("mode", "PREFIXD_MODE", "auto", _one_of(*MODES)),
        http_addr=pick("http", "PREFIXD_HTTP", ""),
        http_token_file=_opt_path(pick("http_token_file", "PREFIXD_HTTP_TOKEN_FILE", None)),
        disk_cache_dir=default_disk_cache_dir(env) if disk_dir is None else (Path(disk_dir) if disk_dir else None),
        disk_budget_bytes=DEFAULT_DISK_BUDGET_BYTES if disk_budget is None else disk_budget,
        idle_exit_s=pick("idle_exit", "PREFIXD_IDLE_EXIT", None, _opt_float),
        draft=pick("draft", "PREFIXD_DRAFT", "auto", _one_of(*DRAFTS)),
        draft_max=pick("draft_max", "PREFIXD_DRAFT_MAX", DEFAULT_DRAFT_MAX, int),
        cuda_graphs=pick("cuda_graphs", "PREFIXD_CUDA_GRAPHS", "auto", _one_of(*CUDA_GRAPHS)),
        overlap=pick("overlap", "PREFIXD_OVERLAP", "auto", _one_of(*OVERLAP)),
        client_frame_rate=pick("client_frame_rate", "PREFIXD_CLIENT_FRAME_RATE", DEFAULT_CLIENT_FRAME_RATE, float),
        client_frame_burst=pick("client_frame_burst", "PREFIXD_CLIENT_FRAME_BURST", DEFAULT_CLIENT_FRAME_BURST, int),
        error_frame_cost=pick("error_frame_cost", "PREFIXD_ERROR_FRAME_COST", DEFAULT_ERROR_FRAME_COST, int),
        connect_frame_cost=pick("connect_frame_cost", "PREFIXD_CONNECT_FRAME_COST", DEFAULT_CONNECT_FRAME_COST,
                                int),
        abandon_grace=pick("abandon_grace", "PREFIXD_ABANDON_GRACE", DEFAULT_ABANDON_GRACE, int),
        abandon_hold_max_s=pick("abandon_hold_max", "PREFIXD_ABANDON_HOLD_MAX", DEFAULT_ABANDON_HOLD_MAX_S, float),
    )
    return _check(cfg)


def resolve_draft(draft: str, family: str, mode: str, draft_head: bool = False) -> str:
    """`draft` itself, or for "auto" the drafter `AUTO_DRAFT` names for the loaded model's
    family and numeric mode ("off" where none was measured to pay); for a model with MTP
    layers (`draft_head`), `AUTO_DRAFT_HEAD` first."""
    if draft != "auto":
        return draft
    if draft_head and (family, mode) in AUTO_DRAFT_HEAD:
        return AUTO_DRAFT_HEAD[family, mode]
    return AUTO_DRAFT.get((family, mode), "off")


def _size_or_auto(text: str) -> int | None:
    try:
        return parse_size(str(text))
    except ConfigError:
        raise ValueError("expected BYTES (e.g. 4GiB, 512M) or auto") from None


def _opt_float(text: str) -> float | None:
    return None if text in (None, "") else float(text)


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return parse


def _device(text: str) -> str:
    if text != "cpu" and not re.fullmatch(r"cuda(:\d+)?", text):
        raise ValueError("expected cpu or cuda[:N]")
    return text


def _env_flag(env: dict[str, str], name: str) -> bool:
    """A 1/0 switch from the environment (unset: 1)."""
    value = env.get(name, "1")
    if value not in ("0", "1"):
        raise ConfigError(f"{name}={value!r}: expected 1 or 0")
    return value == "1"


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
