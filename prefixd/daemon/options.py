"""Every option of `prefixd serve`, declared once: `OPTIONS`.

From each row come the flag of `prefixd serve` and its help (cli.py), the PREFIXD_* variable
read when the flag is unset, the `DaemonConfig` field and its default, and the option's own
check (config.py). docs/operations.md lists the same flags, variables and defaults, and
tests/daemon/test_options.py holds them equal. Adding an option is adding a row.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from prefixd.front.abandon import HOLD_BASE_S, AbandonLimits
from prefixd.text.hygiene import DEFAULT_NORMALISERS, NORMALISERS, hygiene_names

# Defaults resolved once the device is known (DaemonConfig.num_lanes); the context's once the
# model is loaded and the memory left is known (DaemonConfig.resolved_max_context).
DEFAULT_CPU_LANES = 8
DEFAULT_CUDA_LANES = 16
# The share of the memory left after loading (host RAM, or free device memory) the KV pool
# may take: every lane's full context first (it bounds the default context), then with
# `--cache-budget auto` the prefix cache in what is left of it.
KV_MEMORY_FRACTION = 0.5  # the --max-context row says "half"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


@dataclass(frozen=True, slots=True)
class Option:
    """One option of `prefixd serve`.

    `default` is the DaemonConfig field's default; None where it is resolved later, and then
    `shown` says how (help and docs show `shown`, else the default itself). A bool default
    makes a switch: the flag sets the field to `not default`, the variable takes 1 or 0.
    `parse` reads the flag's or the variable's text and raises ValueError with what it
    expected; a parse that gives None means the default. `check` says what is wrong with a
    parsed value (None: nothing). `unset` gives the value when neither flag nor variable is
    set, where that depends on the environment.
    """

    flag: str
    field: str
    env: str
    default: Any
    help: str
    parse: Callable[[Any], Any] = str
    choices: tuple[str, ...] = ()
    shown: str | None = None
    metavar: str | None = None
    check: Callable[[Any], str | None] | None = None
    unset: Callable[[Mapping[str, str]], Any] | None = None

    @property
    def dest(self) -> str:
        """The argparse attribute the flag sets."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def is_switch(self) -> bool:
        return isinstance(self.default, bool)

    @property
    def shown_default(self) -> str:
        if self.shown is not None:
            return self.shown
        return show_value(self.default)

    @property
    def annotation(self) -> str:
        """The DaemonConfig field's type, from what `parse` returns."""
        kind = {str: "str", int: "int", float: "float"}.get(self.parse) or self.parse.__annotations__["return"]
        return kind if self.default is not None or "None" in kind else f"{kind} | None"

    def help_text(self) -> str:
        """The flag's help: the row's, then its choices, default and variable."""
        choices = f"; one of {', '.join(self.choices)}" if self.choices else ""
        return f"{self.help}{choices} (default: {self.shown_default}; env {self.env})"


def show_value(value: Any) -> str:
    """A value as help, docs and error messages write it: 10 not 10.0, on/off for a switch."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)


# -- parsers: text (or an already typed flag value) -> value; ValueError says what was expected

def size_or_auto(text: str) -> int | None:
    """"auto" -> None; "4GiB", "512M", "1000000" -> bytes (k/M/G decimal, Ki/Mi/Gi binary)."""
    text = str(text)
    if text.strip().lower() == "auto":
        return None
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError("expected BYTES (e.g. 4GiB, 512M) or auto")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _UNITS[unit])


def device(text: str) -> str:
    if text != "cpu" and not re.fullmatch(r"cuda(:\d+)?", text):
        raise ValueError("expected cpu or cuda[:N]")
    return text


def text_or_none(text: str) -> str | None:
    return str(text) or None


def path_or_none(text: str) -> Path | None:
    return Path(str(text)) if text not in (None, "") else None


def seconds_or_never(text: str) -> float | None:
    if text in (None, ""):
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError("expected a number of seconds") from None


def one_or_zero(text: str) -> bool:
    if text not in ("1", "0"):
        raise ValueError("expected 1 or 0")
    return text == "1"


# -- checks: a parsed value -> what is wrong with it, or None

def at_least(low: float) -> Callable[[Any], str | None]:
    return lambda value: None if value >= low else f"must be >= {low:g}"


def above(low: float) -> Callable[[Any], str | None]:
    return lambda value: None if value > low else f"must be > {low:g}"


def finite_at_least(low: float) -> Callable[[Any], str | None]:
    return lambda value: None if low <= value < math.inf else f"must be a finite number >= {low:g}"


def off_or_at_least(low: float) -> Callable[[Any], str | None]:
    return lambda value: None if value == 0 or low <= value < math.inf else f"must be 0 (off) or a number >= {low:g}"


def kv_events_endpoint(value: str) -> str | None:
    """What is wrong with a --kv-events endpoint ("" is off), pyzmq's absence included."""
    if not value:
        return None
    import importlib.util

    from prefixd.engine.kv_events import parse_endpoint

    try:
        parse_endpoint(value)
    except ValueError as e:
        return str(e)
    if importlib.util.find_spec("zmq") is None:
        return "needs pyzmq: pip install 'prefixd[kv-events]'"
    return None


_SOCKET = "$XDG_RUNTIME_DIR/prefixd/prefixd.sock, else /run/prefixd/prefixd.sock for root, else /tmp/prefixd-$UID/prefixd.sock"
_DISK_CACHE = "$STATE_DIRECTORY under systemd, else $XDG_CACHE_HOME/prefixd, else ~/.cache/prefixd"


def _default_disk_cache_dir(env: Mapping[str, str]) -> Path:
    """$STATE_DIRECTORY (systemd's StateDirectory=, the first if several), else
    $XDG_CACHE_HOME/prefixd, else ~/.cache/prefixd."""
    state = env.get("STATE_DIRECTORY", "").split(":")[0]
    if state:
        return Path(state)
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg else Path(env.get("HOME") or Path.home()) / ".cache"
    return base / "prefixd"


OPTIONS: tuple[Option, ...] = (
    Option("--model", "model", "PREFIXD_MODEL", "default",
           '"default" (SmolLM2-135M-Instruct), a FILE.gguf or a Hugging Face model dir'),
    Option("--device", "device", "PREFIXD_DEVICE", "cpu", "cpu or cuda[:N]", parse=device),
    Option("--dtype", "dtype", "PREFIXD_DTYPE", "bf16", "compute dtype", choices=("bf16", "fp32")),
    # numeric modes (prefixd.gpu.model.MODES); auto is resolved by prefixd.gpu.families.resolve_mode
    Option("--mode", "mode", "PREFIXD_MODE", "auto",
           "numeric mode: invariant = weights in the dtype, int4 = 4-bit weights (CPU bf16); auto: int4 where "
           "it exists on CPU bf16, else invariant", choices=("auto", "invariant", "int4")),
    Option("--lanes", "lanes", "PREFIXD_LANES", None, "concurrent streams", parse=int, check=at_least(1),
           shown=f"{DEFAULT_CPU_LANES} on CPU, {DEFAULT_CUDA_LANES} on CUDA"),
    Option("--socket", "socket_path", "PREFIXD_SOCKET", None, 'where to listen; "" means the default',
           parse=path_or_none, metavar="PATH", shown=_SOCKET),
    Option("--allow-group", "allow_group", "PREFIXD_ALLOW_GROUP", None, "also accept peers of this group",
           parse=text_or_none, metavar="GROUP", shown="none: only this user"),
    Option("--metrics-addr", "metrics_addr", "PREFIXD_METRICS_ADDR", "127.0.0.1:9464",
           'Prometheus exporter; "" turns it off', metavar="HOST:PORT"),
    Option("--cache-budget", "cache_budget_bytes", "PREFIXD_CACHE_BUDGET", None,
           "prefix cache allowance, e.g. 2GiB", parse=size_or_auto, metavar="BYTES|auto", shown="auto"),
    Option("--no-cache", "cache", "PREFIXD_CACHE", True, "turn the prefix cache off", parse=one_or_zero,
           shown="cache on"),
    Option("--page-size", "page_size", "PREFIXD_PAGE_SIZE", 16, "KV rows per page", parse=int, check=at_least(1)),
    Option("--grid", "grid", "PREFIXD_GRID", 256, "prefill chunk length G, a multiple of the page size",
           parse=int, check=at_least(1)),
    # each lane's KV is reserved up front: lanes x context rows must fit (engine/runtime.py, lanes_fit_context)
    Option("--max-context", "max_context", "PREFIXD_MAX_CONTEXT", None, "longest prompt + reply", parse=int,
           check=at_least(2), shown="the model's, as far as every lane's KV fits in half the free memory"),
    Option("--draft", "draft", "PREFIXD_DRAFT", "auto",
           "draft tokens to verify in each decode round: ngram (prompt lookup), mtp (the model's own "
           "multi-token-prediction head; qwen3_5 checkpoints that ship one), off, or auto: the drafter measured "
           "to pay for the model and mode, else off", choices=("auto", "mtp", "ngram", "off")),
    # 7: a lane's last token and 7 drafts are one task of mode int4's attention and one rows-bucket of
    # the decode programs (8 rows); docs/benchmarks.md, *Drafting*
    Option("--draft-max", "draft_max", "PREFIXD_DRAFT_MAX", 7, "most drafted tokens per lane and round",
           parse=int, check=at_least(0)),
    Option("--cuda-graphs", "cuda_graphs", "PREFIXD_CUDA_GRAPHS", "auto",
           "auto: decode rounds replay CUDA graphs captured at start-up (CUDA; the hybrid family: rounds of one "
           "decode row per lane); eager: the same fixed programs run uncaptured, on any device (a check of "
           "them); off: every round runs op by op", choices=("auto", "eager", "off")),
    Option("--overlap", "overlap", "PREFIXD_OVERLAP", "auto",
           "run each round's device call on a thread of its own while the engine takes new requests and seats "
           "them for the next round; auto: on for CUDA, off on the CPU, where the host work is small beside "
           "the round", choices=("auto", "on", "off")),
    Option("--stream-interval", "stream_interval_s", "PREFIXD_STREAM_INTERVAL", 0.02,
           "seconds a stream's later tokens may wait in the engine to travel with the next rounds' (the front "
           "and the client wake once for several rounds); a stream's first token and its end go at once; 0: "
           "every round's tokens at once", parse=float, metavar="SECONDS", check=at_least(0)),
    Option("--grace", "grace_s", "PREFIXD_GRACE_S", 10.0, "on SIGTERM, seconds in-flight streams get to finish",
           parse=float, metavar="SECONDS", check=at_least(0)),
    # above any honest round (at most a round's row budget) and the first after a load: docs/operations.md,
    # *A stalled engine*
    Option("--engine-stall-s", "engine_stall_s", "PREFIXD_ENGINE_STALL_S", 120.0,
           "seconds the engine process may owe an answer (a round's message while requests run, else a status "
           "ping) before it counts as hung: it is killed and restarted, its requests end with internal; 0: never",
           parse=float, metavar="SECONDS", check=off_or_at_least(1)),
    Option("--log-level", "log_level", "PREFIXD_LOG_LEVEL", "info", "log verbosity",
           choices=("debug", "info", "warning", "error")),
    Option("--disk-cache", "disk_cache_dir", "PREFIXD_DISK_CACHE", None,
           'disk tier below the prefix cache; "" turns it off', parse=path_or_none, metavar="DIR",
           shown=_DISK_CACHE, unset=_default_disk_cache_dir),
    Option("--disk-budget", "disk_budget_bytes", "PREFIXD_DISK_BUDGET", 8 << 30,
           "bytes the disk tier may hold; 0 turns it off", parse=size_or_auto, metavar="BYTES", shown="8GiB",
           check=at_least(0)),
    Option("--shared-cache", "shared_cache_url", "PREFIXD_SHARED_CACHE", "",
           "a Redis or Valkey server the disk tier also sends its entries to and fetches the ones it lacks from, "
           "shared by daemons of the same model and mode: redis://HOST:PORT/DB or unix:///PATH (docs/scale.md)",
           metavar="URL", shown="off"),
    Option("--kv-events", "kv_events", "PREFIXD_KV_EVENTS", "",
           "publish the prefix store's pages (and a hybrid family's snapshots) as vLLM KV events on this ZMQ "
           "PUB endpoint, tcp://HOST:PORT or ipc://PATH, ?topic=NAME to name the topic, &layout=map for vLLM's "
           "tagged-map events (vllm-router's kv_aware) instead of the array ones (docs/scale.md)",
           metavar="URL", shown="off", check=kv_events_endpoint),
    Option("--kv-events-replay", "kv_events_replay", "PREFIXD_KV_EVENTS_REPLAY", "",
           "with --kv-events, a ZMQ ROUTER endpoint where a router that missed events asks for them again (or "
           "for a snapshot of the store)", metavar="URL", shown="off", check=kv_events_endpoint),
    Option("--idle-exit", "idle_exit_s", "PREFIXD_IDLE_EXIT", None,
           "flush the disk tier and exit after this many seconds with no client and no request; for "
           "socket-activated units", parse=seconds_or_never, metavar="SECONDS", shown="never", check=above(0)),
    Option("--http", "http_addr", "PREFIXD_HTTP", "",
           "also serve the OpenAI-compatible HTTP API here, see docs/http.md", metavar="HOST:PORT", shown="off"),
    Option("--http-token-file", "http_token_file", "PREFIXD_HTTP_TOKEN_FILE", None,
           "bearer token HTTP clients must send; required to listen beyond loopback", parse=path_or_none,
           metavar="FILE"),
    Option("--prompt-hygiene", "prompt_hygiene", "PREFIXD_PROMPT_HYGIENE", DEFAULT_NORMALISERS,
           f"the HTTP front's prompt hygiene, comma-separated rules from {', '.join(NORMALISERS)}, or none "
           "(docs/http.md)", parse=hygiene_names, metavar="NAMES", shown=",".join(DEFAULT_NORMALISERS)),
    Option("--client-frame-rate", "client_frame_rate", "PREFIXD_CLIENT_FRAME_RATE", 500.0,
           "frames a second one client (peer process, all its connections) is read at, beyond its burst; "
           "0: unpaced", parse=float, metavar="FRAMES", check=at_least(0)),
    Option("--client-frame-burst", "client_frame_burst", "PREFIXD_CLIENT_FRAME_BURST", 4096,
           "frames a client may send at once", parse=int, metavar="FRAMES", check=at_least(1)),
    Option("--error-frame-cost", "error_frame_cost", "PREFIXD_ERROR_FRAME_COST", 16,
           "what a frame refused with an error costs a client", parse=int, metavar="FRAMES", check=at_least(1)),
    Option("--connect-frame-cost", "connect_frame_cost", "PREFIXD_CONNECT_FRAME_COST", 64,
           "what a new connection costs a client", parse=int, metavar="FRAMES", check=at_least(0)),
    Option("--abandon-grace", "abandon_grace", "PREFIXD_ABANDON_GRACE", 6,
           "generates a client may abandon (cancel, or hang up on) before its next ones wait while other "
           f"clients are served; one is forgiven every {1 / AbandonLimits().drain_per_s:g} s", parse=int,
           metavar="N", check=at_least(0)),
    Option("--abandon-hold-max", "abandon_hold_max_s", "PREFIXD_ABANDON_HOLD_MAX", 30.0,
           f"the longest such wait in seconds, doubling from {HOLD_BASE_S:g} s past the grace; 0: never wait",
           parse=float, metavar="SECONDS", check=finite_at_least(0)),
)


def option(flag: str) -> Option:
    """The row of `flag`."""
    return next(o for o in OPTIONS if o.flag == flag)
