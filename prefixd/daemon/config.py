"""`DaemonConfig`: the one frozen configuration of a running daemon, built once from flags + env."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_METRICS_ADDR = "127.0.0.1:9464"
DEFAULT_CPU_LANES = 8
DEFAULT_CUDA_LANES = 16
DEFAULT_PAGE_SIZE = 16
DEFAULT_GRID = 256
DEFAULT_GRACE_S = 10.0
# Without --max-context a CPU daemon caps the context: each lane's KV is reserved up front.
DEFAULT_CPU_MAX_CONTEXT = 4096
# `--cache-budget auto`: this share of the memory left after weights, lanes and workspace.
AUTO_CACHE_FRACTION = 0.5
AUTO_CACHE_MAX_BYTES_CPU = 4 << 30  # host RAM is shared with everything else on the machine
# numeric modes (prefixd.gpu.model.MODES); "auto" is resolved by prefixd.gpu.families.resolve_mode
MODES = ("auto", "invariant", "int4")
DEFAULT_DISK_BUDGET_BYTES = 8 << 30

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


def _disk_budget(text: str) -> int | None:
    try:
        return parse_size(text)
    except ConfigError:
        raise ConfigError(f"--disk-budget {text!r}: expected BYTES (e.g. 8GiB, 512M)") from None


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
    if cfg.grace_s < 0:
        raise ConfigError(f"--grace {cfg.grace_s}: must be >= 0")
    if cfg.max_context is not None and cfg.max_context < 2:
        raise ConfigError(f"--max-context {cfg.max_context}: must be >= 2")
    if cfg.http_addr:
        from prefixd.daemon.http.addr import check_http_addr

        check_http_addr(cfg.http_addr, cfg.http_token_file)
    if cfg.disk_budget_bytes < 0:
        raise ConfigError(f"--disk-budget {cfg.disk_budget_bytes}: must be >= 0")
    if cfg.idle_exit_s is not None and cfg.idle_exit_s <= 0:
        raise ConfigError(f"--idle-exit {cfg.idle_exit_s:g}: must be > 0 seconds")
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
    """Build the config from parsed `serve` flags; PREFIXD_* env fills what flags left unset."""
    env = dict(os.environ) if env is None else env

    def pick(name: str, env_name: str, default: object) -> object:
        value = getattr(args, name, None)
        if value is not None:
            return value
        return env.get(env_name, default)

    lanes = pick("lanes", "PREFIXD_LANES", None)
    socket_text = pick("socket", "PREFIXD_SOCKET", None)
    budget = pick("cache_budget", "PREFIXD_CACHE_BUDGET", "auto")
    max_context = pick("max_context", "PREFIXD_MAX_CONTEXT", None)
    disk_dir = pick("disk_cache", "PREFIXD_DISK_CACHE", None)
    disk_budget = _disk_budget(str(pick("disk_budget", "PREFIXD_DISK_BUDGET", DEFAULT_DISK_BUDGET_BYTES)))
    idle_exit = pick("idle_exit", "PREFIXD_IDLE_EXIT", None)
    try:
        cfg = DaemonConfig(
            model=str(pick("model", "PREFIXD_MODEL", "default")),
            device=str(pick("device", "PREFIXD_DEVICE", "cpu")),
            dtype=str(pick("dtype", "PREFIXD_DTYPE", "bf16")),
            lanes=None if lanes is None else int(lanes),
            socket_path=None if socket_text in (None, "") else Path(str(socket_text)),
            allow_group=pick("allow_group", "PREFIXD_ALLOW_GROUP", None) or None,
            metrics_addr=str(pick("metrics_addr", "PREFIXD_METRICS_ADDR", DEFAULT_METRICS_ADDR)),
            grace_s=float(pick("grace", "PREFIXD_GRACE_S", DEFAULT_GRACE_S)),
            cache=not bool(getattr(args, "no_cache", False)) and env.get("PREFIXD_CACHE", "1") != "0",
            cache_budget_bytes=parse_size(str(budget)),
            page_size=int(pick("page_size", "PREFIXD_PAGE_SIZE", DEFAULT_PAGE_SIZE)),
            grid=int(pick("grid", "PREFIXD_GRID", DEFAULT_GRID)),
            max_context=None if max_context is None else int(max_context),
            log_level=str(pick("log_level", "PREFIXD_LOG_LEVEL", "info")),
            mode=str(pick("mode", "PREFIXD_MODE", "auto")),
            http_addr=str(pick("http", "PREFIXD_HTTP", "")),
            http_token_file=_opt_path(pick("http_token_file", "PREFIXD_HTTP_TOKEN_FILE", None)),
            disk_cache_dir=default_disk_cache_dir(env) if disk_dir is None else (Path(str(disk_dir)) if disk_dir else None),
            disk_budget_bytes=DEFAULT_DISK_BUDGET_BYTES if disk_budget is None else disk_budget,
            idle_exit_s=None if idle_exit in (None, "") else float(idle_exit),
        )
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"bad number in flags or PREFIXD_* environment: {e}") from None
    return _check(cfg)


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
