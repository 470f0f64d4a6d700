"""`prefixd serve` as a real process on a tiny random model: sd_notify, SIGTERM, the CLI,
a live socket never stolen, and socket activation through systemd-socket-activate."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from prefixd.gpu import cpu_kernels
from prefixd.ipc.sync_client import SyncClient
from tests.helpers.tiny_models import make_tiny_hf_dir

ROOT = Path(__file__).resolve().parents[2]
# XDG_CACHE_HOME: the daemons' disk tier (on by default) goes to a directory of this run's own;
# PREFIXD_KERNEL_DIR: mode int4's compiled kernels stay where this process finds them (built once)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
       "XDG_CACHE_HOME": tempfile.mkdtemp(prefix="prefixd-test-cache-"),
       "PREFIXD_KERNEL_DIR": str(cpu_kernels.cache_dir())}
PREFIXD = [sys.executable, "-m", "prefixd.daemon.cli"]
LIVENESS_S = 180  # bounds on waiting for a process, never asserted


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny") / "model")


def _serve_args(model: Path, sock: Path, *extra: str) -> list[str]:
    return [*PREFIXD, "serve", "--model", str(model), "--socket", str(sock), "--metrics-addr", "",
            "--lanes", "2", "--max-context", "512", "--cache-budget", "1M", *extra]


class NotifyReceiver:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(LIVENESS_S)

    def close(self) -> None:
        self.sock.close()

    def until(self, needle: str) -> list[str]:
        seen = []
        while True:
            msg = self.sock.recv(4096).decode()
            seen.append(msg)
            if needle in msg.split("\n"):
                return seen


def _generate_alone_connection(sock: Path):
    def run(prompt: str) -> tuple[int, ...]:
        with SyncClient(sock) as client:
            return client.generate(prompt=prompt, max_tokens=6).collect().ids

    return run


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PREFIXD, *args], capture_output=True, text=True, env=ENV, timeout=LIVENESS_S)


def test_serve_notifies_ready_serves_the_cli_and_exits_0_on_sigterm(tiny_dir, tmp_path):
    sock = tmp_path / "run" / "p.sock"
    notify = NotifyReceiver(tmp_path / "notify")
    proc = subprocess.Popen(_serve_args(tiny_dir, sock, "--grace", "0.2"), env={**ENV, "NOTIFY_SOCKET": str(notify.path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = notify.until("READY=1")
        assert seen[0] == "STATUS=loading model"
        assert seen[-1] == f"READY=1\nSTATUS=listening on {sock}"
        with SyncClient(sock) as client:  # listening by the time READY=1 arrives
            assert client.status()["model"]["family"] == "llama"

        out = _cli("generate", "--socket", str(sock), "--prompt", "Hello", "--max-tokens", "4", "--json")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert set(result) == {"text", "tokens", "finish_reason", "usage", "sampling"}
        assert result["sampling"]["temperature"] == 0.7 and isinstance(result["sampling"]["seed"], int)
        assert result["finish_reason"] in ("length", "stop")
        assert result["usage"]["completion_tokens"] == len(result["tokens"])

        chat = subprocess.run([*PREFIXD, "chat", "--socket", str(sock), "--max-tokens", "3"], input="hi\n/reset\nhey\n/exit\n",
                              capture_output=True, text=True, env=ENV, timeout=LIVENESS_S)
        assert chat.returncode == 0, chat.stderr
        assert "(conversation reset)" in chat.stderr
        # one prompt per input line, a reply (sampled by default: it may hold a newline of its
        # own) after "hi" and after "hey", none after /reset
        assert re.fullmatch(r"> (.+)\n> > (.+)\n> ", chat.stdout, re.S), chat.stdout

        prompts = ["one", "two two", "three three three", "four"]
        with SyncClient(sock) as client:
            solo = [client.generate(prompt=p, max_tokens=6).collect().ids for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(_generate_alone_connection(sock), prompts))
        assert together == solo

        messages = tmp_path / "messages.json"
        messages.write_text(json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]))
        out = _cli("generate", "--socket", str(sock), "--messages", str(messages), "--max-tokens", "2",
                   "--no-cache", "--namespace", "tenant-a", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["usage"]["cache"] == "off"

        status = _cli("status", "--socket", str(sock), "--json")
        assert json.loads(status.stdout)["lanes_busy"] == 0
        human = _cli("status", "--socket", str(sock))
        assert human.returncode == 0, human.stderr
        assert f"prefixd at {sock}" in human.stdout
        assert "\nlanes     0 busy," in human.stdout
        assert "\ncache     " in human.stdout

        second = subprocess.run(_serve_args(tiny_dir, sock), capture_output=True, text=True, env=ENV,
                                timeout=LIVENESS_S)
        assert second.returncode == 1
        assert "already listening" in second.stderr

        with SyncClient(sock) as client:
            stream = iter(client.generate(prompt="count", max_tokens=400))
            events = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            events.extend(stream)
            assert notify.until("STOPPING=1")[-1] == "STOPPING=1"
        assert events[-1].finish_reason in ("cancelled", "length", "stop")
        assert proc.wait(timeout=LIVENESS_S) == 0
        stderr = proc.communicate()[1]
        assert f"prefixd chat --socket {sock}" in stderr
        assert not sock.exists()
    finally:
        _reap(proc)
        notify.close()


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_cli_without_a_daemon_says_how_to_start_one(tmp_path):
    out = _cli("status", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 1
    assert f"no daemon at {tmp_path / 'none.sock'}: start it with `prefixd serve`" in out.stderr


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate missing")
def _accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
    return True


def test_socket_activation_passes_the_listening_socket(tiny_dir, tmp_path):
    sock = tmp_path / "act.sock"
    cmd = ["systemd-socket-activate", "-l", str(sock), "-E", f"PYTHONPATH={ROOT}",
           "-E", f"XDG_CACHE_HOME={ENV['XDG_CACHE_HOME']}",  # the tool passes only what -E names
           "-E", f"PREFIXD_KERNEL_DIR={ENV['PREFIXD_KERNEL_DIR']}",
           *_serve_args(tiny_dir, tmp_path / "unused" / "x.sock")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # systemd-socket-activate binds, then listens, then waits for a client: the file exists
        # a moment before a connect can succeed.
        deadline = time.monotonic() + LIVENESS_S
        while not _accepts(sock):
            if proc.poll() is not None:
                pytest.fail(proc.communicate()[1])
            if time.monotonic() > deadline:
                pytest.fail(f"nothing listens on {sock}")
            time.sleep(0.01)
        with SyncClient(sock) as client:
            status = client.status()
            result = client.generate(tokens=[1, 2, 3], max_tokens=2).collect()
        assert status["socket"] == str(sock)
        assert len(result.ids) <= 2
        assert not (tmp_path / "unused").exists()  # the daemon bound nothing itself
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=LIVENESS_S) == 0
    finally:
        _reap(proc)


def test_a_model_that_cannot_load_exits_1_with_the_reason_and_leaves_no_socket(tmp_path):
    sock = tmp_path / "run" / "p.sock"
    out = subprocess.run(_serve_args(tmp_path / "no-such-model", sock), capture_output=True, text=True, env=ENV,
                         timeout=LIVENESS_S)
    assert out.returncode == 1
    assert "prefixd: cannot load model:" in out.stderr
    assert str(tmp_path / "no-such-model") in out.stderr
    assert not sock.exists()


def test_sighup_is_logged_and_ignored_and_requests_and_shutdown_are_logged(tiny_dir, tmp_path):
    sock = tmp_path / "run" / "p.sock"
    notify = NotifyReceiver(tmp_path / "notify")
    args = _serve_args(tiny_dir, sock, "--grace", "5")
    args[args.index("--max-context") + 1] = "1000000"  # above the tiny model's limit: a warning
    proc = subprocess.Popen(args, env={**ENV, "NOTIFY_SOCKET": str(notify.path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        notify.until("READY=1")
        with SyncClient(sock) as client:
            before = client.generate(tokens=[1, 2, 3], max_tokens=8).collect()
            stream = iter(client.generate(tokens=[1, 2, 3], max_tokens=8))
            first = next(stream)
            proc.send_signal(signal.SIGHUP)
            events = [first, *stream]  # the stream in flight goes on to its done
            assert client.status()["shutting_down"] is False  # a status answered after the SIGHUP
            after = client.generate(tokens=[1, 2, 3], max_tokens=8).collect()
        assert events[-1].finish_reason == "length"
        assert after.ids == before.ids and len(before.ids) == 8
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=LIVENESS_S) == 0
        stderr = proc.communicate()[1]
        assert not sock.exists()
    finally:
        _reap(proc)
        notify.close()
    lines = stderr.splitlines()
    assert "Traceback" not in stderr
    assert sum("SIGHUP ignored" in line for line in lines) == 1
    assert any("--max-context 1000000 is above the model's limit of" in line for line in lines)
    done = [line for line in lines if " length: prompt 3 tokens, " in line]
    assert len(done) == 3, stderr
    assert done[0].startswith("prefixd INFO prefixd.engine: request 1 length: prompt 3 tokens, 0 cached (miss), "
                              "8 generated, ttft "), done[0]
    assert any("stopped after" in line and "exit code 0, 3 requests served" in line for line in lines), stderr
