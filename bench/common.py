"""Helpers shared by the benchmarks: timing with medians, markdown tables, the machine.

Benchmarks print results; nothing here asserts a time.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import AsyncIterator, Callable, Iterable, Sequence

# Between two engines' turns: the last one's spinning threads go to sleep. libgomp's default
# spin holds a core for ~8 ms after a region; an engine that starts inside that spell counts the
# core as taken (its thread policy, prefixd/gpu/threads.py) and runs its first round narrower.
SWITCH_PAUSE_S = 0.05


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds taken by each of `repeats` calls of `fn`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def rate(count: float, seconds: Sequence[float]) -> float:
    """Items per second from the median of several timings of `count` items."""
    return count / median(seconds)


def fmt_rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f}"


def fmt_ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None or theirs == 0:
        return "n/a"
    return f"{ours / theirs:.2f}x"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [all(_looks_numeric(r[i]) for r in cells) and bool(cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        padded = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(list(headers)), rule, *(line(r) for r in cells)])


def _looks_numeric(text: str) -> bool:
    stripped = text.replace(",", "").replace(".", "").replace("x", "").replace("-", "")
    return stripped.isdigit() or text == "n/a"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_description(extra: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(name, value) lines describing the machine and library versions."""
    import torch

    mem = memory_bytes()
    lines = [
        ("cpu", cpu_model()),
        ("logical cpus", str(os.cpu_count())),
        ("torch threads", str(torch.get_num_threads())),
        ("memory", f"{mem / 2**30:.1f} GiB" if mem else "unknown"),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
    ]
    if torch.cuda.is_available():
        lines.append(("cuda device", torch.cuda.get_device_name(0)))
    lines.extend((extra or {}).items())
    return lines


def print_machine(extra: dict[str, str] | None = None) -> None:
    print(markdown_table(["machine", "value"], machine_description(extra)))
    print()


class LlamaCppBaseline:
    """llama.cpp (through llama-cpp-python) on the same GGUF file and thread count.

    One context serves `num_seqs` sequences so batched decode can be compared too.
    """

    def __init__(self, model_path: str, *, threads: int, n_ctx: int, num_seqs: int = 1, n_batch: int = 4096):
        import llama_cpp
        from llama_cpp import _internals

        _quiet_llama_cpp(llama_cpp)
        self.version = llama_cpp.__version__
        self.n_batch = n_batch
        self._model = _internals.LlamaModel(
            path_model=model_path, params=llama_cpp.llama_model_default_params(), verbose=False
        )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, 512)
        params.n_seq_max = num_seqs
        params.kv_unified = True  # n_ctx is shared by all sequences, not split evenly
        params.n_threads = threads
        params.n_threads_batch = threads
        self._ctx = _internals.LlamaContext(model=self._model, params=params, verbose=False)
        self._batch = _internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=num_seqs, verbose=False)

    def clear(self) -> None:
        self._ctx.kv_cache_clear()

    def decode(self, rows: Sequence[tuple[int, int, int]]) -> None:
        """One llama_decode over (seq_id, position, token) rows; logits for every row."""
        if len(rows) > self.n_batch:
            raise ValueError(f"{len(rows)} rows exceed n_batch {self.n_batch}")
        b = self._batch.batch
        b.n_tokens = len(rows)
        for i, (seq, pos, token) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, False
            b.seq_id[i][0] = seq
        b.logits[len(rows) - 1] = True
        self._ctx.decode(self._batch)

    def prefill(self, tokens: Sequence[int], *, seq: int = 0, start: int = 0) -> None:
        """Prefill `tokens` for `seq` from position `start`, in n_batch pieces."""
        for i in range(0, len(tokens), self.n_batch):
            piece = tokens[i : i + self.n_batch]
            self.decode([(seq, start + i + j, t) for j, t in enumerate(piece)])

    def truncate(self, seq: int, length: int) -> None:
        """Forget positions >= length of `seq` (to repeat a decode from the same context)."""
        self._ctx.kv_cache_seq_rm(seq, length, -1)


_LOG_CALLBACK: object = None  # kept alive: llama.cpp holds the raw pointer


def _quiet_llama_cpp(llama_cpp: object) -> None:
    """Drop llama.cpp's log lines so the table is the only output."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        import ctypes

        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (0..1) of `values`; nan when there are none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class ServedDaemon:
    """A `prefixd serve` child on a Unix socket in a temp dir (and, with `http=True`, an HTTP
    front on a free loopback port), run from the source tree `root`, stopped on exit.

        with ServedDaemon(["--disk-cache", ""], http=True) as daemon:
            daemon.socket, daemon.http_url, daemon.log_text()
    """

    def __init__(self, flags: Sequence[str], *, model: str = "default", http: bool = False,
                 metrics: bool = False, root: str | None = None, ready_timeout_s: float = 600.0) -> None:
        self.flags, self.model, self.http, self.metrics = list(flags), model, http, metrics
        self.root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.ready_timeout_s = ready_timeout_s
        self.socket = ""
        self.http_url: str | None = None  # http://127.0.0.1:PORT
        self.metrics_url: str | None = None  # http://127.0.0.1:PORT/metrics
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServedDaemon:
        self._tmp = tempfile.TemporaryDirectory(prefix="prefixd-bench-")
        self.socket = os.path.join(self._tmp.name, "prefixd.sock")
        self.log = os.path.join(self._tmp.name, "daemon.log")
        cmd = [sys.executable, "-m", "prefixd.daemon.cli", "serve", "--model", self.model, "--socket", self.socket,
               "--metrics-addr", "127.0.0.1:0" if self.metrics else "", *self.flags]
        if self.http:
            cmd += ["--http", "127.0.0.1:0"]  # the daemon binds a free port and prints it
        env = {**os.environ, "PYTHONPATH": self.root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            text = self.log_text()
            http = re.search(r"HTTP on (http://[^/\s]+)", text)
            metrics = re.search(r"metrics on [^:\s]+:(\d+)", text)
            if "prefixd: listening on" in text and (http or not self.http) and (metrics or not self.metrics):
                self.http_url = http.group(1) if http else None
                self.metrics_url = f"http://127.0.0.1:{metrics.group(1)}/metrics" if metrics else None
                return
            assert self.proc is not None, "__enter__ started it"
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefixd exited with {self.proc.returncode}:\n{text[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"prefixd did not listen within {self.ready_timeout_s:.0f} s")

    def log_text(self) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()

    def __exit__(self, *exc_info: object) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._tmp.cleanup()


async def sse_events(reply: object) -> AsyncIterator[tuple[str, dict]]:
    """(event name, JSON data) of each server-sent event of an httpx streaming `reply`, each
    `data:` line one event (prefixd writes each event's JSON on one line); the name is ""
    where the event has no `event:` line. `data: [DONE]` is skipped."""
    import json

    name = ""
    async for line in reply.aiter_lines():  # type: ignore[attr-defined]
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            text = line[5:].strip()
            if text != "[DONE]":
                yield name, json.loads(text)
            name = ""
