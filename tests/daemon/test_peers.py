"""SO_PEERCRED: a peer of another uid is refused unless --allow-group admits its group.

Runs a client as uid/gid 65534 (nobody/nogroup) when the tests run as root; the socket's
directory and file are opened up by the test so that only the daemon's own check stands.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import anyio
import msgpack
import pytest

from tests.daemon.harness import running_server, wait_idle

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                                reason="needs root to run a client under another uid")

_CLIENT = r"""
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
s.connect(sys.argv[1])
data = b""
try:
    s.sendall(bytes.fromhex(sys.argv[2]))
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) >= 4 and len(data) >= 4 + struct.unpack(">I", data[:4])[0]:
            break
except (ConnectionResetError, BrokenPipeError):
    pass
print("reply" if data else "closed")
"""


def _status_frame() -> str:
    body = msgpack.packb({"type": "status", "id": 1})
    return (len(body).to_bytes(4, "big") + body).hex()


@pytest.fixture
def open_dir():
    # pytest's tmp dirs are 0700; another uid must be able to reach the socket.
    base = Path(tempfile.mkdtemp(prefix="prefixd-peers-"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _open_up(path) -> None:
    os.chmod(path.parent, 0o777 | 0o1000)
    os.chmod(path, 0o666)


def _run_as_nobody(path) -> str:
    out = subprocess.run(["/usr/bin/python3", "-I", "-c", _CLIENT, str(path), _status_frame()],
                         user=65534, group=65534, extra_groups=[], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


async def test_peer_of_another_uid_is_refused(open_dir):
    async with running_server(open_dir) as server:
        _open_up(server.socket_path)
        assert await anyio.to_thread.run_sync(_run_as_nobody, server.socket_path) == "closed"
        await wait_idle(server)


async def test_allow_group_admits_peers_of_that_group(open_dir):
    async with running_server(open_dir, allow_group="nogroup") as server:
        assert os.lstat(server.socket_path).st_gid == 65534
        _open_up(server.socket_path)
        assert await anyio.to_thread.run_sync(_run_as_nobody, server.socket_path) == "reply"
        await wait_idle(server)
