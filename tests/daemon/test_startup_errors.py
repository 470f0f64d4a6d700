"""`prefixd serve` start-up failures, each through a real process: one line on stderr, a
non-zero exit, no traceback, and no model load (the model path does not exist, so a check
that ran after the load would report the missing model instead)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
PREFIXD = [sys.executable, "-m", "prefixd.daemon.cli"]
LIVENESS_S = 120  # a bound on waiting for the process, never asserted


def _serve(tmp_path: Path, *extra: str, sock: Path | None = None, env: dict[str, str] | None = None,
           prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    sock = sock or tmp_path / "run" / "p.sock"
    argv = [*prefix, *PREFIXD, "serve", "--model", str(tmp_path / "no-such-model"), "--socket", str(sock),
            "--metrics-addr", "", *extra]
    return subprocess.run(argv, capture_output=True, text=True, env={**ENV, **(env or {})}, timeout=LIVENESS_S)


def _one_line(out: subprocess.CompletedProcess, code: int) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == code, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("prefixd: ")
    assert "cannot load model" not in lines[0]  # failed before the load
    return lines[0]


def test_metrics_address_in_use_names_the_flag(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        line = _one_line(_serve(tmp_path, "--metrics-addr", addr), 1)
    assert line == (f"prefixd: --metrics-addr {addr}: the address is in use; pass another --metrics-addr, "
                    "or --metrics-addr '' to turn the exporter off")
    assert not (tmp_path / "run" / "p.sock").exists()


def test_metrics_address_that_is_not_host_port_names_the_flag(tmp_path):
    line = _one_line(_serve(tmp_path, "--metrics-addr", "9464"), 2)
    assert line.startswith("prefixd: --metrics-addr '9464': expected HOST:PORT")


def test_socket_parent_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    sock = tmp_path / "file" / "p.sock"
    line = _one_line(_serve(tmp_path, sock=sock), 1)
    assert line == f"prefixd: --socket {sock}: a parent of the path is not a directory"


def _can_mount_read_only(directory: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "ro", "none", str(directory)],
                           capture_output=True, timeout=LIVENESS_S)
    return probe.returncode == 0


def test_socket_on_a_read_only_filesystem(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _can_mount_read_only(ro):
        pytest.skip("no user namespaces to mount a read-only tmpfs in")
    sock = ro / "sub" / "p.sock"
    # a private mount namespace where `ro` is a read-only tmpfs, then exec the daemon in it
    script = f'mount -t tmpfs -o ro none "{ro}" && exec "$@"'
    line = _one_line(_serve(tmp_path, sock=sock, prefix=("unshare", "-rm", "sh", "-c", script, "sh")), 1)
    assert line == (f"prefixd: --socket {sock}: the filesystem is read-only; choose a path on a writable one "
                    "(e.g. under $XDG_RUNTIME_DIR)")


def test_a_live_daemon_on_the_socket_is_never_replaced(tmp_path):
    sock = tmp_path / "run" / "p.sock"
    sock.parent.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(sock))
        live.listen()
        line = _one_line(_serve(tmp_path, sock=sock), 1)
        assert sock.exists()
    assert line == (f"prefixd: a prefixd daemon is already listening on {sock}; stop it first or pass another "
                    "--socket")


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build")
def test_cuda_on_a_cpu_only_torch_says_how_to_get_a_cuda_build(tmp_path):
    line = _one_line(_serve(tmp_path, "--device", "cuda"), 1)
    assert line.startswith(f"prefixd: --device cuda: this torch {torch.__version__} is a CPU-only build")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu128" in line
    assert not (tmp_path / "run" / "p.sock").exists()


@pytest.mark.parametrize(("env", "line"), [
    ({"PREFIXD_LANES": "abc"}, "prefixd: PREFIXD_LANES='abc': expected an integer"),
    ({"PREFIXD_GRACE_S": "soon"}, "prefixd: PREFIXD_GRACE_S='soon': expected a number"),
    ({"PREFIXD_CACHE": "yes"}, "prefixd: PREFIXD_CACHE='yes': expected 1 or 0"),
    ({"PREFIXD_CACHE_BUDGET": "lots"}, "prefixd: PREFIXD_CACHE_BUDGET='lots': expected BYTES (e.g. 4GiB, 512M) or auto"),
    ({"PREFIXD_LOG_LEVEL": "loud"}, "prefixd: PREFIXD_LOG_LEVEL='loud': expected one of debug, info, warning, error"),
    ({"PREFIXD_DEVICE": "tpu"}, "prefixd: PREFIXD_DEVICE='tpu': expected cpu or cuda[:N]"),
])
def test_a_bad_environment_variable_is_named(tmp_path, env, line):
    assert _one_line(_serve(tmp_path, env=env), 2) == line


def test_an_unknown_group_is_one_line(tmp_path):
    line = _one_line(_serve(tmp_path, "--allow-group", "no-such-group-prefixd"), 1)
    assert line == "prefixd: --allow-group 'no-such-group-prefixd': no such group"


def test_version():
    out = subprocess.run([*PREFIXD, "--version"], capture_output=True, text=True, env=ENV, timeout=LIVENESS_S)
    import prefixd

    assert (out.returncode, out.stdout) == (0, f"prefixd {prefixd.__version__}\n")


def test_an_unexpected_error_is_one_line_with_a_pointer_to_the_traceback(tmp_path, monkeypatch, capsys):
    from prefixd.daemon import cli, server

    def broken(cfg):
        raise ValueError("a bug")

    monkeypatch.setattr(server, "serve", broken)
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)  # leave this process's SIGHUP alone
    assert cli.main(["serve", "--socket", str(tmp_path / "p.sock"), "--metrics-addr", ""]) == 70
    err = capsys.readouterr().err
    assert err == "prefixd: internal error: ValueError('a bug') (--log-level debug shows the traceback)\n"


def test_a_cpu_whose_bf16_products_follow_the_row_count_is_refused_before_the_load(tmp_path):
    """Row invariance is checked before the model loads: here a sitecustomize makes bf16
    `torch.bmm` give the last query row of every odd-sized call other bits, as a library that
    picks its kernel by row count would (attention's products are not split into calls of
    fixed rows on any CPU, so this fails the check everywhere)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch\n"
        "_bmm = torch.bmm\n"
        "def _varying(a, b, **kw):\n"
        "    out = _bmm(a, b, **kw)\n"
        "    if a.dtype == torch.bfloat16 and a.shape[1] % 2:\n"
        "        out[:, -1] = out[:, -1].add(1)\n"
        "    return out\n"
        "torch.bmm = _varying\n")
    env = {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    out = _serve(tmp_path, "--device", "cpu", env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "cannot load model" not in out.stderr  # refused before the load (after its progress line)
    assert out.stderr.splitlines()[-1].startswith(
        "prefixd: bf16 products on this CPU give a row other bits depending on the call's row count (bmm at 1 rows")
