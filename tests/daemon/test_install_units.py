"""`prefixd install-units`: the shipped units written with this install's ExecStart, for the
system and for `--user`, and accepted by `systemd-analyze verify` where it is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefixd.daemon.units import UnitsError, default_dir, render, source_dir

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ANALYZE = shutil.which("systemd-analyze")
LIVENESS_S = 120


def _install(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixd.daemon.cli", "install-units", *args],
                          capture_output=True, text=True, env=ENV, timeout=LIVENESS_S)


def _exec_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("ExecStart=")]


def _verify(directory: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([ANALYZE, *extra, "verify", "./prefixd.service", "./prefixd.socket"], cwd=directory,
                          capture_output=True, text=True, timeout=LIVENESS_S, env=env)


@pytest.mark.parametrize(("flags", "socket_arg"), [((), "/run/prefixd/prefixd.sock"),
                                                   (("--user",), "%t/prefixd/prefixd.sock")])
def test_install_units_points_exec_start_at_this_prefixd(tmp_path, flags, socket_arg):
    out = _install(*flags, "--dir", str(tmp_path / "units"))
    assert out.returncode == 0, out.stderr
    script = Path(sys.executable).parent / "prefixd"
    expected = str(script.absolute()) if script.is_file() else f"{sys.executable} -m prefixd.daemon.cli"
    shipped = ROOT / "systemd" / ("user" if flags else "")
    [shipped_line] = _exec_lines(shipped / "prefixd.service")
    program, _, shipped_args = shipped_line.removeprefix("ExecStart=").partition(" ")
    assert program.endswith("/prefixd") and shipped_args.startswith(f"serve --model default --socket {socket_arg}")
    assert _exec_lines(tmp_path / "units" / "prefixd.service") == [f"ExecStart={expected} {shipped_args}"]
    assert (tmp_path / "units" / "prefixd.socket").read_text() == (shipped / "prefixd.socket").read_text()
    assert out.stdout.splitlines()[:2] == [f"wrote {tmp_path / 'units' / 'prefixd.service'}",
                                           f"wrote {tmp_path / 'units' / 'prefixd.socket'}"]
    ctl = "systemctl --user" if flags else "systemctl"
    assert out.stdout.splitlines()[-1] == f"  {ctl} enable --now prefixd.socket"


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
def test_installed_system_units_verify(tmp_path):
    out = _install("--dir", str(tmp_path), "--exec", "/bin/true")
    assert out.returncode == 0, out.stderr
    verified = _verify(tmp_path)
    assert (verified.returncode, verified.stderr.strip()) == (0, "")


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
def test_installed_user_units_verify_with_the_default_exec_start(tmp_path):
    out = _install("--user", "--dir", str(tmp_path / "units"))
    assert out.returncode == 0, out.stderr
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    verified = _verify(tmp_path / "units", "--user", env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert (verified.returncode, verified.stderr.strip()) == (0, "")


def test_render_replaces_only_the_program_and_quotes_spaces():
    text = "[Service]\nExecStart=/usr/local/bin/prefixd serve --x\nExecStartPre=/bin/true\n"
    assert render(text, '"/opt/my env/bin/prefixd"') == (
        '[Service]\nExecStart="/opt/my env/bin/prefixd" serve --x\nExecStartPre=/bin/true\n')


def test_default_dirs_and_a_missing_source(tmp_path):
    assert default_dir(False) == Path("/etc/systemd/system")
    assert default_dir(True, {"XDG_CONFIG_HOME": "/cfg"}) == Path("/cfg/systemd/user")
    with pytest.raises(UnitsError, match="the shipped units are not in"):
        source_dir(True, roots=(tmp_path,))


def test_an_unwritable_directory_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    out = _install("--dir", str(tmp_path / "file" / "units"))
    assert out.returncode == 1
    assert out.stderr.startswith(f"prefixd: cannot write the units to {tmp_path / 'file' / 'units'}: ")
    assert len(out.stderr.splitlines()) == 1


@pytest.mark.parametrize("where", ["", "user"])
def test_units_bound_descriptors_and_tasks(where):
    text = (ROOT / "systemd" / where / "prefixd.service").read_text()
    assert "\nLimitNOFILE=65536\n" in text and "\nTasksMax=1024\n" in text


def test_the_user_unit_turns_metrics_off_so_two_users_never_share_a_port():
    from argparse import Namespace

    from prefixd.daemon.config import config_from_args

    text = (ROOT / "systemd" / "user" / "prefixd.service").read_text()
    assert "\nEnvironment=PREFIXD_METRICS_ADDR=\n" in text
    assert "--metrics-addr" not in text  # a flag would win over the drop-in a user writes
    assert config_from_args(Namespace(), env={"PREFIXD_METRICS_ADDR": ""}).metrics_addr == ""
