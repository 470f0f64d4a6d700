"""A hung engine process (alive, not answering: here SIGSTOP) is noticed by the front, killed
and restarted; an engine that is only slow is left alone. Real engine processes
(ProcessLauncher) over the letters device, with a small stall bound."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time
from typing import Any

import anyio
import pytest

from prefixd.engine.link import BlockingLink, LinkReader, pack
from prefixd.engine.process import EngineLoop, RecordingObserver
from prefixd.front.engine_link import PING_SHARE, ProcessLauncher
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.errors import ClientError
from tests.daemon.fakes import LetterDevice, fake_runtime_factory, letter_factory
from tests.daemon.test_engine_process import letters_config, letters_engine, metric, process_server, wait_serving

STALL_S = 5.0  # the bound these tests run under (the daemon's default is far longer)
SLOW_ROUND_S = 1.6  # an honest round longer than the ping interval, well under the bound
assert STALL_S * PING_SHARE < SLOW_ROUND_S < STALL_S / 2


def overlap_letter_factory(**device_args: Any):
    """`letter_factory` with the engine's overlap on: each round on a device thread (the CUDA path's)."""
    inner = letter_factory(**device_args)

    def factory(cfg: Any, observer: Any) -> Any:
        return dataclasses.replace(inner(cfg, observer), overlap=True)

    return factory


async def gone(pid: int) -> None:
    """Wait until process `pid` no longer exists (killed and reaped, not left stopped)."""
    with anyio.fail_after(30):
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            await anyio.sleep(0.05)


async def test_an_engine_stopped_mid_stream_ends_the_stream_with_internal_and_is_restarted(tmp_path):
    """The engine is SIGSTOPped while a request streams: the request ends with `internal`
    saying the engine stopped answering and is being restarted; the front kills the stopped
    process, starts another, and a request afterwards gets the same bits as before."""
    cfg = letters_config(tmp_path, engine_stall_s=STALL_S)
    async with process_server(tmp_path, letters_engine(cfg, round_delay_s=0.02), cfg) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            before = await client.generate(prompt="solo prompt", max_tokens=6, logits=True).collect()
        first_pid = server.link.pid
        async with await AsyncClient.connect(server.socket_path) as client:
            stream = await client.generate(prompt="long", max_tokens=200).start()
            tokens = 0
            with pytest.raises(ClientError) as lost, anyio.fail_after(STALL_S * 6):
                async for _ in stream:
                    tokens += 1
                    if tokens == 3:
                        os.kill(first_pid, signal.SIGSTOP)  # alive, holding its lane, answering nothing
        assert lost.value.code == "internal"
        assert "the engine stopped answering for" in lost.value.message
        assert "restarted" in lost.value.message
        await gone(first_pid)

        await wait_serving(server)
        assert server.link.pid != first_pid
        async with await AsyncClient.connect(server.socket_path) as client:
            after = await client.generate(prompt="solo prompt", max_tokens=6, logits=True).collect()
        assert (after.ids, after.logits_sha256) == (before.ids, before.logits_sha256)
        assert (server.link.stalls, server.link.restarts) == (1, 1)
        assert metric(server, "prefixd_engine_restarts_total") == 1
        assert server.link.num_open_streams == 0
        said = server._out.getvalue()  # noqa: SLF001 - what the daemon said
        assert f"the engine (pid {first_pid}) stopped answering for" in said and "killing it" in said
        status = await server.link.status(check=True)
        assert status["integrity"] is None and status["lanes_busy"] == 0


async def test_an_idle_engine_that_stops_answering_is_found_by_the_ping_and_restarted(tmp_path):
    """Nothing runs, so no round message is missed: the status ping goes unanswered, and the
    engine is killed and restarted all the same; the next request is served as usual."""
    cfg = letters_config(tmp_path, engine_stall_s=STALL_S)
    async with process_server(tmp_path, letters_engine(cfg), cfg) as server:
        first_pid = server.link.pid
        with anyio.fail_after(60):  # an idle engine answers its pings
            while server.link.pings < 2:
                await anyio.sleep(0.05)
        assert server.link.stalls == 0
        os.kill(first_pid, signal.SIGSTOP)
        with anyio.fail_after(STALL_S * 6):
            while server.link.restarts < 1:
                await anyio.sleep(0.05)
        await gone(first_pid)
        assert server.link.stalls == 1
        assert server.link.last_death is not None and "stopped answering" in server.link.last_death
        async with await AsyncClient.connect(server.socket_path) as client:
            result = await client.generate(prompt="abc", max_tokens=3).collect()
        assert (result.text, result.finish_reason) == ("cde", "length")
        assert server.link.pid != first_pid


@pytest.mark.parametrize("factory", ["tests.daemon.fakes:letter_factory",
                                     "tests.daemon.test_engine_stall:overlap_letter_factory"],
                         ids=["rounds", "overlapped rounds"])
async def test_a_slow_but_honest_engine_is_pinged_and_not_killed(tmp_path, factory):
    """Each round takes longer than the ping interval, but under the bound: the front pings it
    mid-round, the engine answers after the round (also with the round on its device thread),
    and the request is served in full by the same engine."""
    cfg = letters_config(tmp_path, engine_stall_s=STALL_S)
    launcher = ProcessLauncher(cfg, factory=factory, factory_args={"round_delay_s": SLOW_ROUND_S})
    async with process_server(tmp_path, launcher, cfg) as server:
        pid = server.link.pid
        async with await AsyncClient.connect(server.socket_path) as client:
            result = await client.generate(prompt="abc", max_tokens=4).collect()
        assert (result.text, result.finish_reason) == ("cdef", "length")
        assert server.link.pings >= 1  # a ping went while a round ran
        assert (server.link.stalls, server.link.restarts, server.link.pid) == (0, 0, pid)


def test_a_ping_alone_starts_no_idle_trim_of_the_engine():
    """An idle engine answers status pings without counting them as work: only a command
    (here a cancel) makes its idle heap trim due, once, `idle_trim_s` later."""
    observer = RecordingObserver()
    runtime = fake_runtime_factory(LetterDevice())(None, observer)
    ours, theirs = socket.socketpair()
    trimmed = threading.Event()
    loop = EngineLoop(BlockingLink(theirs), runtime, observer, idle_trim_s=0.2, trim=trimmed.set)
    thread = threading.Thread(target=loop.run)
    thread.start()
    reader = LinkReader()
    ours.settimeout(60)
    try:
        for q in (1, 2, 3):
            ours.sendall(pack({"t": "status", "q": q, "check": False})[0])
            replies: list[dict[str, Any]] = []
            while not replies:
                replies = reader.feed(ours.recv(1 << 20), [])
            assert [r["t"] for r in replies] == ["status"] and replies[0]["q"] == q
        time.sleep(1.0)  # five trim delays: a trim a ping had made due would have run by now
        assert loop.num_trims == 0
        ours.sendall(pack({"t": "cancel", "id": 7})[0])
        assert trimmed.wait(60)
    finally:
        ours.sendall(pack({"t": "stop"})[0])
        thread.join(60)
        reader.close()
        ours.close()
    assert loop.num_trims == 1
