"""sd_notify datagrams, watchdog interval, socket activation fd handling (in-process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from prefixd.daemon.systemd import Notifier, take_activation_socket, watchdog_interval_s


def _receiver(path: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    return sock


def test_notify_sends_datagrams_to_a_path_socket(tmp_path):
    path = str(tmp_path / "notify")
    with _receiver(path) as rx:
        n = Notifier({"NOTIFY_SOCKET": path})
        assert n.enabled
        assert n.ready("listening on /x")
        assert n.stopping()
        assert rx.recv(4096) == b"READY=1\nSTATUS=listening on /x"
        assert rx.recv(4096) == b"STOPPING=1"


def test_notify_supports_abstract_addresses():
    name = f"prefixd-test-{os.getpid()}"
    with _receiver(b"\0" + name.encode()) as rx:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).watchdog()
        assert rx.recv(4096) == b"WATCHDOG=1"


def test_notify_without_socket_is_a_no_op():
    n = Notifier({})
    assert not n.enabled
    assert n.ready("x") is False


def test_notify_to_a_missing_socket_reports_false_instead_of_raising(tmp_path):
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}).status("x") is False


def test_watchdog_interval_is_half_of_watchdog_usec_for_this_pid():
    assert watchdog_interval_s({"WATCHDOG_USEC": "4000000"}) == 2.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}) == 2.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({}) is None


def test_no_listen_fds_means_no_activation_socket():
    env = {"LISTEN_PID": str(os.getpid())}
    assert take_activation_socket(env) is None
    assert env == {}


def test_activation_env_for_another_pid_is_ignored_and_unset():
    env = {"LISTEN_FDS": "1", "LISTEN_PID": "1", "LISTEN_FDNAMES": "x"}
    assert take_activation_socket(env) is None
    assert env == {}


_CHILD = r"""
import os, socket, sys
from prefixd.daemon.systemd import take_activation_socket, ActivationError
os.dup2(int(sys.argv[2]), 3)
os.close(int(sys.argv[2]))
env = {"LISTEN_FDS": sys.argv[1], "LISTEN_PID": str(os.getpid())}
try:
    sock = take_activation_socket(env)
except ActivationError as e:
    print("error:", e); sys.exit(0)
print(sock.fileno(), sock.family == socket.AF_UNIX, sorted(env), os.get_inheritable(3))
"""


def _run_child_with_fd3(sock: socket.socket, nfds: str) -> str:
    # The child moves `sock` to fd 3, as systemd would pass it.
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, nfds, str(sock.fileno())], pass_fds=(sock.fileno(),), capture_output=True,
        text=True, timeout=60, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_activation_takes_a_listening_unix_socket_on_fd_3(tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(tmp_path / "s"))
        listener.listen()
        assert _run_child_with_fd3(listener, "1") == "3 True [] False"


def test_activation_rejects_a_socket_that_is_not_listening(tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        assert _run_child_with_fd3(s, "1") == "error: socket activation passed a socket that is not listening"


def test_activation_rejects_more_than_one_fd(tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        assert "prefixd takes exactly one" in _run_child_with_fd3(s, "2")
