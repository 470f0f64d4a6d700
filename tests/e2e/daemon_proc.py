"""A real `prefixd serve` process on a tmp socket, for end-to-end tests.

`DaemonProcess.start(model, sock, *flags)` spawns the daemon with the metrics exporter off,
waits until its socket answers `status`, and `stop()` sends SIGTERM and returns the exit
status. The environment is cleaned of PREFIXD_* variables so only the flags configure it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from prefixd.ipc.errors import ClientError
from prefixd.ipc.sync_client import SyncClient
from tests.helpers.device import TEST_DEVICE

ROOT = Path(__file__).resolve().parents[2]
PREFIXD = [sys.executable, "-m", "prefixd.daemon.cli"]
LIVENESS_S = 300  # bounds on waiting for a process, never asserted


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that were free just now: every socket is bound
    before any is closed, so two calls' worth of ports cannot coincide within one test (a port
    just released may be handed out again, and a daemon's HTTP front once met its own KV-event
    publisher on one). Another program may still take one before the daemon binds it."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def process_env() -> dict[str, str]:
    """The environment for daemon and CLI processes: this checkout first, no PREFIXD_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class DaemonDied(RuntimeError):
    """The daemon process exited while a test expected it to serve."""


@dataclass
class DaemonProcess:
    """A running daemon: its process, socket and log file (stdout and stderr)."""

    proc: subprocess.Popen
    socket: Path
    log: Path

    @classmethod
    def start(cls, model: str | Path, workdir: Path, *flags: str) -> DaemonProcess:
        """Spawn `prefixd serve --model MODEL --socket WORKDIR/run/prefixd.sock FLAGS...` and
        return once the socket answers; raises DaemonDied with the log if it exits first."""
        workdir.mkdir(parents=True, exist_ok=True)
        sock = workdir / "run" / "prefixd.sock"
        log = workdir / "daemon.log"
        args = [*PREFIXD, "serve", "--model", str(model), "--socket", str(sock), "--metrics-addr", "", *flags]
        if "--disk-cache" not in flags:  # each daemon its own disk tier, never warm from another test's
            args += ["--disk-cache", str(workdir / "disk")]
        if TEST_DEVICE != "cpu" and "--device" not in flags:
            args += ["--device", TEST_DEVICE]
        with log.open("wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=process_env())
        daemon = cls(proc, sock, log)
        daemon._wait_listening()
        return daemon

    def _wait_listening(self) -> None:
        while True:
            self.check_alive()
            if self.socket.exists():
                try:
                    with SyncClient(self.socket) as client:
                        client.status()
                    return
                except (OSError, ClientError):
                    pass  # bound but not accepting yet
            try:
                self.proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass

    @classmethod
    def start_with_store_budget(cls, model: str | Path, workdir: Path, store_bytes: int, reserved_guess: int,
                                *flags: str) -> DaemonProcess:
        """Start a daemon whose store gets exactly `store_bytes`.

        `--cache-budget` pays for weights, lane state and the prefill workspace first; the
        daemon's own figure for that share is read back from `status` (budget given minus
        store budget), and the daemon restarted with it when `reserved_guess` was off.
        """
        reserved = reserved_guess
        for attempt in range(3):
            given = reserved + store_bytes
            daemon = cls.start(model, workdir / f"try{attempt}", *flags, "--cache-budget", str(given))
            budget = daemon.status()["store"]["budget_bytes"]
            if budget == store_bytes:
                return daemon
            daemon.stop()
            # Store budget 0 only says the guess was too small: try a far larger one.
            reserved = given - budget if budget > 0 else 4 * given
        raise AssertionError(f"could not give the store {store_bytes} bytes; last store budget {budget}")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise DaemonDied(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text(errors='replace')}")

    def client(self) -> SyncClient:
        self.check_alive()
        return SyncClient(self.socket)

    def status(self) -> dict[str, Any]:
        with self.client() as client:
            return client.status()

    def stop(self) -> int:
        """SIGTERM, then wait for the exit status (kill after LIVENESS_S)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=LIVENESS_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def idle_view(status: dict[str, Any]) -> dict[str, Any]:
    """The parts of a status that say whether the daemon is idle and what it holds."""
    return {
        "lanes_busy": status["lanes_busy"],
        "waiting": status["waiting"],
        "busy_lanes": [lane["lane"] for lane in status["lanes"] if lane["state"] == "busy"],
        "pages_used": status["pages_used"],
        "pages_free": status["pages_free"],
    }


def serving(model: str | Path, workdir: Path, *flags: str) -> Iterator[DaemonProcess]:
    """For a fixture: run a daemon while the fixture lives; its clean exit on SIGTERM is checked."""
    daemon = DaemonProcess.start(model, workdir, *flags)
    yield from stopping(daemon)


def stopping(daemon: DaemonProcess) -> Iterator[DaemonProcess]:
    """Yield `daemon`, then stop it and check it exited 0."""
    try:
        yield daemon
    finally:
        code = daemon.stop()
    assert code == 0, f"daemon exited with {code} on SIGTERM:\n{daemon.log.read_text(errors='replace')}"
