"""--idle-exit under socket activation: the daemon flushes its disk tier and exits when no
client is connected and no request is open; the next client starts it again (here the test
starts systemd-socket-activate again, as systemd does on the next connection), and that
client's next turn hits from disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixd.ipc.sync_client import SyncClient
from tests.helpers.tiny_models import make_tiny_hf_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate missing"),
]

ROOT = Path(__file__).resolve().parents[2]
LIVENESS_S = 180  # bounds on waiting for a process, never asserted
PREFIX = list(range(100, 140))


def _activate(model: Path, sock: Path, disk: Path, log: Path) -> subprocess.Popen:
    sock.unlink(missing_ok=True)  # systemd keeps its socket; the stand-in binds it anew
    cmd = ["systemd-socket-activate", "-l", str(sock), "-E", f"PYTHONPATH={ROOT}",
           sys.executable, "-m", "prefixd.daemon.cli", "serve", "--model", str(model),
           "--socket", str(sock.parent / "unused.sock"), "--metrics-addr", "", "--lanes", "1",
           "--max-context", "512", "--cache-budget", "64M", "--disk-cache", str(disk), "--idle-exit", "1"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + LIVENESS_S
    while not sock.exists():  # systemd-socket-activate binds first, then waits for a client
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(log.read_text())
        time.sleep(0.01)
    return proc


def _wait_exit(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=LIVENESS_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_idle_daemon_exits_and_the_next_activation_is_warm_from_disk(tmp_path):
    model = make_tiny_hf_dir(tmp_path / "model", "llama", seed=5)
    sock, disk = tmp_path / "act.sock", tmp_path / "disk"
    proc = _activate(model, sock, disk, tmp_path / "one.log")
    with SyncClient(sock) as client:
        first = client.generate(tokens=PREFIX, max_tokens=3).collect()
    assert first.usage.cached_tokens == 0
    assert _wait_exit(proc) == 0  # nobody connected for 1 s: flushed and gone
    log = (tmp_path / "one.log").read_text()
    assert "idle for 1s: exiting" in log and "disk cache flushed (1 entries)" in log
    assert len(list(disk.glob("*.pxc"))) == 1

    proc = _activate(model, sock, disk, tmp_path / "two.log")
    try:
        with SyncClient(sock) as client:
            warm = client.generate(tokens=PREFIX + [7, 8, 9], max_tokens=3).collect()
            cold = client.generate(tokens=PREFIX + [7, 8, 9], max_tokens=3, cache=False).collect()
            status = client.status()
        assert warm.usage.cache == "hit" and warm.usage.cached_tokens == len(PREFIX)
        assert status["disk"]["hit_tokens"] == len(PREFIX)
        assert warm.ids == cold.ids
    finally:
        assert _wait_exit(proc) == 0
