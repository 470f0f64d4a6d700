"""A real Redis (or Valkey) server on a Unix socket of its own, for the shared-tier tests.

Skips the test when neither server binary nor the redis package is installed. No TCP port
is opened (`--port 0`), so tests never collide on one.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


class RedisServer:
    """One server process; `url` is what `--shared-cache` takes."""

    def __init__(self) -> None:
        binary = shutil.which("valkey-server") or shutil.which("redis-server")
        if binary is None:
            pytest.skip("no valkey-server or redis-server on PATH")
        self.redis = pytest.importorskip("redis")
        # a socket path must fit in sun_path (108 bytes): pytest's tmp_path may not
        self.dir = Path(tempfile.mkdtemp(prefix="pxr-"))
        self.socket = self.dir / "redis.sock"
        self.url = f"unix://{self.socket}"
        self.proc = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = self.redis.Redis(unix_socket_path=str(self.socket))
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.ping()
                return
            except self.redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{binary} did not start") from None
                time.sleep(0.02)

    def keys(self) -> list[bytes]:
        """The entry keys the server holds (not the list of cuts beside them)."""
        return sorted(k for k in self.client.keys("prefixd:*") if not k.endswith(b":cuts"))

    def stop(self) -> None:
        """Kill the server (as a crash would) and wait for it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def close(self) -> None:
        self.stop()
        self.client.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def redis_server():
    server = RedisServer()
    try:
        yield server
    finally:
        server.close()
