"""Heavy builds run in worker processes of their own at HEAVY_NICE and under SCHED_IDLE, light
ones on a thread of the front, small plain ones on the event loop; a client gone mid-render
stops it; a worker that dies fails only its job, and the next heavy job is served; through a
real daemon, a huge chat render happens in a worker process and answers exactly as a
thread's render would."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import anyio
import pytest

from prefixd.daemon import server as server_module
from prefixd.front.bounds import ConnectionBounds
from prefixd.front.gate import HEAVY_MESSAGES, INLINE_CHARS, INLINE_TOKENS, Gate, GateClient, is_inline
from prefixd.front.heavy import HEAVY_NICE, BuildJob, HeavyWorkers
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.errors import ErrorCode, ProtocolError
from tests.daemon.fakes import LetterDevice
from tests.daemon.harness import running_server

HEAVY = {"messages": [{"role": "user", "content": "x"}] * (HEAVY_MESSAGES + 1)}
SMALL = {"prompt": "short"}
LIGHT = {"prompt": "x" * (INLINE_CHARS + 1)}
STOP_WAIT_S = 60.0  # a liveness bound on a render waiting to be told to stop


class Where:
    """A builder whose `tokenize` says where it ran, or (by the message) waits to be told to
    stop, fails, or kills its own process."""

    def tokenize(self, msg: dict[str, Any], client_gone: Any = None) -> Any:
        action = msg.get("action")
        if action == "wait":
            deadline = time.monotonic() + STOP_WAIT_S
            while not client_gone() and time.monotonic() < deadline:
                time.sleep(0.01)
            return "stopped" if client_gone() else "never told"
        if action == "fail":
            raise ProtocolError(ErrorCode.BAD_REQUEST, "messages: no", 7)
        if action == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        return (os.getpid(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), _policy(),
                threading.get_ident())


def _policy() -> int | None:
    return os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def make_gate(slots: int = 1) -> Gate:
    bounds = ConnectionBounds(max_heavy_jobs=slots)
    return Gate(None, bounds, 1, Where(), HeavyWorkers(Where, slots))  # type: ignore[arg-type]


def test_only_small_plain_builds_run_on_the_loop():
    assert is_inline({"tokens": [1] * INLINE_TOKENS}) and is_inline({"prompt": "x" * INLINE_CHARS})
    assert is_inline({"text": "hello"}) and is_inline({"tokens": [5, 6], "response_format": {"type": "text"}})
    for msg in ({"tokens": [1] * (INLINE_TOKENS + 1)}, {"prompt": "x" * (INLINE_CHARS + 1)},
                {"messages": [{"role": "user", "content": "hi"}]}, {"tokens": [1], "images": [{}]},
                {"prompt": "hi", "tools": [{"type": "function"}]},
                {"prompt": "hi", "response_format": {"type": "json_object"}},
                {"prompt": ["not", "a", "string"]}, {"tokens": "not a list"}):
        assert not is_inline(msg), msg


async def test_heavy_work_runs_in_a_niced_worker_process_and_light_work_in_the_front():
    gate = make_gate()
    client = GateClient("someone")
    try:
        assert not gate.heavy.started  # nothing is started before the first heavy job
        small = await gate.build(client, SMALL, BuildJob("tokenize", (SMALL,)), probe=lambda: False)
        assert small == (os.getpid(), os.getpriority(os.PRIO_PROCESS, 0), _policy(), threading.get_ident())
        *light, light_thread = await gate.build(client, LIGHT, BuildJob("tokenize", (LIGHT,)), probe=lambda: False)
        assert light == [os.getpid(), os.getpriority(os.PRIO_PROCESS, 0), _policy()]
        assert light_thread != threading.get_ident()  # a worker thread: the loop goes on meanwhile
        assert not gate.heavy.started
        pid, nice, policy, _ = await gate.build(client, HEAVY, BuildJob("tokenize", (HEAVY,)), probe=lambda: False)
        assert pid != os.getpid() and parent_of(pid) == os.getpid()  # a worker process of ours
        assert nice == max(os.getpriority(os.PRIO_PROCESS, 0), min(19, HEAVY_NICE))
        if hasattr(os, "SCHED_IDLE") and policy is not None:
            assert policy == os.SCHED_IDLE  # any task that wakes takes its core at once
        again, *_ = await gate.build(client, HEAVY, BuildJob("tokenize", (HEAVY,)), probe=lambda: False)
        assert again == pid  # the worker is kept
    finally:
        gate.heavy.close()
    assert not gate.heavy.started


async def test_a_client_gone_mid_render_stops_it_and_its_error_crosses_whole():
    gate = make_gate()
    client = GateClient("someone")
    gone = False
    try:
        async with anyio.create_task_group() as tg:
            async def leave() -> None:
                nonlocal gone
                await anyio.sleep(0.3)
                gone = True

            tg.start_soon(leave)
            wait = {**HEAVY, "action": "wait"}
            with anyio.fail_after(STOP_WAIT_S / 2):
                assert await gate.build(client, wait, BuildJob("tokenize", (wait,)), probe=lambda: gone) == "stopped"
        fail = {**HEAVY, "action": "fail"}
        with pytest.raises(ProtocolError) as error:
            await gate.build(client, fail, BuildJob("tokenize", (fail,)), probe=lambda: False)
        assert (error.value.code, error.value.message, error.value.request_id) == \
            (ErrorCode.BAD_REQUEST, "messages: no", 7)
        assert gate.heavy_running == 0
    finally:
        gate.heavy.close()


async def test_a_worker_that_dies_fails_its_job_alone_and_the_next_heavy_job_is_served():
    gate = make_gate()
    client = GateClient("someone")
    try:
        die = {**HEAVY, "action": "die"}
        with pytest.raises(ProtocolError) as error:
            await gate.build(client, die, BuildJob("tokenize", (die,)), probe=lambda: False)
        assert error.value.code == ErrorCode.INTERNAL and "died" in error.value.message
        pid, *_ = await gate.build(client, HEAVY, BuildJob("tokenize", (HEAVY,)), probe=lambda: False)
        assert pid != os.getpid() and parent_of(pid) == os.getpid()
        assert gate.heavy_running == 0
    finally:
        gate.heavy.close()


async def test_a_huge_chat_through_the_socket_is_rendered_in_a_worker_process_with_the_same_tokens(tmp_path):
    heavy = [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(HEAVY_MESSAGES + 2)]
    async with running_server(tmp_path) as server:
        builder = server._builder
        expected = builder.tokenize({"type": "tokenize", "id": 1, "messages": heavy})
        async with await AsyncClient.connect(server.socket_path) as client:
            got = await client.tokenize(messages=heavy)
        assert server.gate.heavy.started
        assert (tuple(got.ids), tuple(got.message_starts)) == (expected.ids, expected.message_starts)
        assert (server.gate.heavy_running, server.gate.heavy_waiting) == (0, 0)


async def test_the_front_hands_freed_heap_back_once_an_idle_spell_and_status_counts_it(tmp_path, monkeypatch):
    """After work (here a generate held open), the front trims its heap once it has been idle
    IDLE_TRIM_S, once a spell; status's front_trims counts the trims (bench/soak.py waits for
    it before it reads RSS)."""
    monkeypatch.setattr(server_module, "IDLE_TRIM_S", 0.4)
    device = LetterDevice(num_lanes=1)
    async with running_server(tmp_path, device) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            assert (await client.status())["front_trims"] == 0
            device.gate.clear()
            held = await client.generate(prompt="held", max_tokens=2).start()
            with anyio.fail_after(30):  # liveness bounds, not timing assertions
                while not device.waiting:
                    await anyio.sleep(0.01)
            await anyio.sleep(2.0)  # the trim loop looks every IDLE_TRIM_S / 4: it sees the stream, held 20 looks
            assert server.num_trims == 0  # not while a stream is open (a status would wait for the round)
            device.gate.set()
            await held.collect()
            with anyio.fail_after(30):
                while (await client.status())["front_trims"] == 0:
                    await anyio.sleep(0.05)
            await anyio.sleep(1.0)  # more than twice IDLE_TRIM_S, idle all along
            assert (await client.status())["front_trims"] == 1  # once a spell
