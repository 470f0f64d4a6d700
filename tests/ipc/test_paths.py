"""Default socket path: env override, XDG runtime dir, root, else a per-uid /tmp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prefixd.ipc.paths import default_socket_path


def test_prefixd_socket_overrides_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXD_SOCKET", "/x/y.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path() == Path("/x/y.sock")


def test_xdg_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFIXD_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path() == Path("/run/user/1000/prefixd/prefixd.sock")


@pytest.mark.parametrize(("uid", "expected"), [(0, "/run/prefixd/prefixd.sock"), (1234, "/tmp/prefixd-1234/prefixd.sock")])
def test_without_xdg_root_and_users(monkeypatch: pytest.MonkeyPatch, uid: int, expected: str) -> None:
    monkeypatch.delenv("PREFIXD_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(os, "getuid", lambda: uid)
    assert default_socket_path() == Path(expected)


def test_empty_variables_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXD_SOCKET", "")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    monkeypatch.setattr(os, "getuid", lambda: 77)
    assert default_socket_path() == Path("/tmp/prefixd-77/prefixd.sock")


def test_ipc_imports_nothing_else_from_prefixd() -> None:
    import subprocess
    import sys

    code = (
        "import sys, prefixd.ipc, prefixd.ipc.client, prefixd.ipc.sync_client;"
        "bad = sorted(m for m in sys.modules if m.startswith('prefixd.') and not m.startswith('prefixd.ipc')"
        " or m in ('torch', 'numpy'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stdout + done.stderr
