"""The daemon process a soak runs against: spawn, readiness, RSS, fds and pages."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import anyio

from bench.daemon import stop_process
from prefixd.engine.memory import IDLE_TRIM_S
from prefixd.gpu.threads import stat_cpu_s, stat_fields
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.messages import HelloReply

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 600.0
RSS_EVERY_S = 0.2


@dataclass
class Daemon:
    """A running `prefixd serve` (Unix socket only, metrics off)."""

    proc: subprocess.Popen
    socket: str
    log: Path
    hidden: int = 0
    peak_rss: int = 0
    http_url: str | None = None  # http://127.0.0.1:PORT when spawned with `http`

    @classmethod
    @contextmanager
    def spawn(cls, model: str, flags: Sequence[str], root: Path = ROOT, *, http: bool = False) -> Iterator[Daemon]:
        """`root`: the source tree the daemon runs from (another checkout compares code);
        `http`: the HTTP front on a free loopback port too."""
        with tempfile.TemporaryDirectory(prefix="prefixd-soak-") as tmp:
            sock, log = os.path.join(tmp, "prefixd.sock"), Path(tmp) / "daemon.log"
            cmd = [sys.executable, "-m", "prefixd.daemon.cli", "serve", "--model", model, "--socket", sock,
                   "--metrics-addr", "", *(["--http", "127.0.0.1:0"] if http else []), *flags]
            env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root)
            daemon = cls(proc, sock, log)
            try:
                daemon._wait_ready(http)
                yield daemon
            finally:
                stop_process(proc)

    def _wait_ready(self, http: bool) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            text = self.log.read_text()
            found = re.search(r"HTTP on (http://[^/\s]+)", text)
            if "prefixd: listening on" in text and (found or not http):
                self.http_url = found.group(1) if found else None
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefixd exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"prefixd did not listen within {READY_TIMEOUT_S:.0f} s")

    def log_tail(self, chars: int = 2000) -> str:
        return self.log.read_text()[-chars:]

    def pids(self) -> list[int]:
        """The front process and its children (the engine process, the heavy worker and the
        resource tracker of its pool)."""
        return [self.proc.pid, *self._children()]

    def _children(self) -> dict[int, float]:
        """The front's live child processes, with the CPU seconds (user + system) each used."""
        out = {}
        for pid in os.listdir("/proc"):
            fields = stat_fields(f"/proc/{pid}/stat") if pid.isdigit() else None
            if fields is not None and int(fields[1]) == self.proc.pid:
                out[int(pid)] = stat_cpu_s(fields)
        return out

    def rss_bytes(self) -> int:
        """The RSS of the front and its children together."""
        return sum(self.rss_by_process().values())

    def rss_by_process(self) -> dict[str, int]:
        """RSS by process: "front", "engine", "heavy" (the heavy render workers together) and
        "other" (the pool's resource tracker)."""
        out: dict[str, int] = {}
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/status") as f:
                    rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            except OSError:
                continue
            name = self._role(pid)
            out[name] = out.get(name, 0) + rss
        return out

    def _role(self, pid: int) -> str:
        """The process's part in the daemon: "front", "engine", "heavy" (a heavy render worker)
        or "other" (the pool's resource tracker, or a process that ended)."""
        if pid == self.proc.pid:
            return "front"
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            return "other"
        return "engine" if b"prefixd.engine" in cmdline else "heavy" if b"spawn_main" in cmdline else "other"

    def num_fds(self) -> int:
        total = 0
        for pid in self.pids():
            try:
                total += len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                pass
        return total

    def thread_cpu_s(self) -> dict[int, float]:
        """CPU seconds (user + system) each of the daemon's threads has used, by thread id;
        the thread whose id is the process id runs the event loop."""
        out = {}
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            fields = stat_fields(f"/proc/{self.proc.pid}/task/{tid}/stat")
            if fields is not None:  # else a worker thread that ended
                out[int(tid)] = stat_cpu_s(fields)
        return out

    def children_cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) the daemon's live child processes used, by role (`_role`):
        the engine process apart from the heavy render workers, which run at the lowest priority
        and are not the engine's work."""
        out: dict[str, float] = {}
        for pid, cpu_s in self._children().items():
            role = self._role(pid)
            out[role] = out.get(role, 0.0) + cpu_s
        return out

    async def sample_rss(self, deadline: float) -> None:
        """Track the peak RSS until `deadline`."""
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.peak_rss = max(self.peak_rss, self.rss_bytes())
            await anyio.sleep(RSS_EVERY_S)

    async def hello(self) -> HelloReply:
        async with await AsyncClient.connect(self.socket) as client:
            return await client.hello(client="soak")

    async def measure(self, settle_timeout_s: float) -> dict[str, int]:
        """RSS, fds and pages once no lane is busy and nothing waits (or the timeout passes),
        and both processes have handed their freed heap back (each does once after IDLE_TRIM_S
        idle: wait for both trim counts to move, or for 3 x IDLE_TRIM_S)."""
        deadline = time.monotonic() + settle_timeout_s
        async with await AsyncClient.connect(self.socket) as client:
            while True:
                status = await client.status()
                if (status["lanes_busy"] == 0 and status["waiting"] == 0) or time.monotonic() > deadline:
                    break
                await anyio.sleep(0.1)
            trims = (status.get("engine_trims"), status.get("front_trims"))
            trimmed_by = time.monotonic() + 3 * IDLE_TRIM_S
            while time.monotonic() < trimmed_by:
                await anyio.sleep(0.25)
                now = await client.status()
                if all(a is None or b != a for a, b in zip(trims, (now.get("engine_trims"), now.get("front_trims")))):
                    break
        self.peak_rss = max(self.peak_rss, self.rss_bytes())
        return {"rss": self.rss_bytes(), "rss_by": self.rss_by_process(), "fds": self.num_fds(),
                "processes": len(self.pids()),
                "pages_used": status["pages_used"],
                "lanes_busy": status["lanes_busy"], "waiting": status["waiting"]}
