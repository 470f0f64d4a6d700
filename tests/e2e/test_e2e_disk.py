"""The disk tier end to end: a daemon stopped with SIGTERM, or killed with SIGKILL between two
turns of a conversation, is restarted on the same --disk-cache; the next turn hits from disk
and its token ids and logits digests equal a cold run's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.agent_chat import CHAT_A, SYSTEM_PROMPT, Step, generate, run_sync, turn_messages
from tests.e2e.daemon_proc import LIVENESS_S, DaemonProcess
from prefixd.ipc.client import AsyncClient

pytestmark = pytest.mark.slow

MAX_TOKENS = 5
FLAGS = ("--lanes", "2", "--max-context", "1024", "--cache-budget", "64M")


async def _turn(socket: Path, messages, **fields) -> Step:
    async with await AsyncClient.connect(socket) as client:
        return await generate(client, messages, max_tokens=MAX_TOKENS, **fields)


@pytest.fixture(scope="module")
def cold(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Turns 0 and 1 of chat "a" with the store off: the requests and what they give."""
    daemon = DaemonProcess.start(tiny_llama_dir, tmp_path_factory.mktemp("d_disk_cold"), *FLAGS, "--disk-cache", "")
    try:
        first = turn_messages(SYSTEM_PROMPT, CHAT_A, [])
        step0 = run_sync(_turn, daemon.socket, first, cache=False)
        second = turn_messages(SYSTEM_PROMPT, CHAT_A, [step0.text])
        step1 = run_sync(_turn, daemon.socket, second, cache=False)
    finally:
        assert daemon.stop() == 0
    return first, second, step1


def _wait_written(daemon: DaemonProcess) -> dict:
    """The disk stats once every queued entry file is written."""
    deadline = time.monotonic() + LIVENESS_S
    while time.monotonic() < deadline:
        disk = daemon.status()["disk"]
        if disk["entries"] and disk["written_bytes"] >= disk["bytes"]:
            return disk
        time.sleep(0.05)
    raise AssertionError(f"entry files not written: {disk}")


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_restarted_daemon_hits_from_disk_and_answers_as_a_cold_run(tiny_llama_dir, tmp_path, cold, how):
    first, second, expected = cold
    disk = tmp_path / "disk"
    daemon = DaemonProcess.start(tiny_llama_dir, tmp_path / "one", *FLAGS, "--disk-cache", str(disk))
    try:
        run_sync(_turn, daemon.socket, first)
        written = _wait_written(daemon)
    finally:
        if how == "sigkill":
            daemon.proc.kill()
            daemon.proc.wait()
        else:
            assert daemon.stop() == 0
    assert written["corrupt"] == 0
    again = DaemonProcess.start(tiny_llama_dir, tmp_path / "two", *FLAGS, "--disk-cache", str(disk))
    try:
        step = run_sync(_turn, again.socket, second)
        status = again.status()
    finally:
        assert again.stop() == 0
    assert (step.ids, step.digests) == (expected.ids, expected.digests)
    assert step.usage.cached_tokens > 0
    assert status["disk"]["hit_tokens"] == step.usage.cached_tokens  # RAM was empty: all from disk
    assert status["disk"]["corrupt"] == 0
