"""`systemd-analyze verify` on the shipped units (system and user), warnings included."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"
ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def _copy_with_exec(src: Path, dst: Path, exec_path: str) -> None:
    # verify checks that ExecStart exists; point it at a real binary in a tmp copy.
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("prefixd.service", "prefixd.socket"):
        text = (src / name).read_text()
        text = text.replace("/usr/local/bin/prefixd", exec_path).replace("%h/.local/bin/prefixd", exec_path)
        (dst / name).write_text(text)


def _verify(directory: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([ANALYZE, *extra, "verify", "./prefixd.service", "./prefixd.socket"], cwd=directory,
                          capture_output=True, text=True, timeout=120, env=env)


def test_system_units_verify_without_warnings(tmp_path):
    _copy_with_exec(UNITS, tmp_path, "/bin/true")
    out = _verify(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == ""


def test_user_units_verify_without_warnings(tmp_path):
    _copy_with_exec(UNITS / "user", tmp_path / "units", "/bin/true")
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    out = _verify(tmp_path / "units", "--user", env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == ""


def test_system_unit_is_notify_with_hardening_that_keeps_nvidia_devices():
    text = (UNITS / "prefixd.service").read_text()
    for line in ("Type=notify", "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=read-only",
                 "PrivateTmp=yes", "RuntimeDirectory=prefixd", "RuntimeDirectoryMode=0700",
                 "DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=char-nvidia-uvm rw", "WatchdogSec=60s"):
        assert f"\n{line}\n" in text, line
    socket_text = (UNITS / "prefixd.socket").read_text()
    assert "\nListenStream=/run/prefixd/prefixd.sock\n" in socket_text
    assert "\nSocketMode=0600\n" in socket_text
