"""Heavy host work is bounded: one heavy render at a time in the daemon (as configured), a
light render beside it goes straight through, and a heavy job pauses to keep its CPU share."""

from __future__ import annotations

import dataclasses
import threading

import anyio

from prefixd.front.bounds import ConnectionBounds
from prefixd.daemon.host_work import HEAVY_MESSAGES, SLICE_S, CpuShare, is_heavy
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.transport import FramedStream
from tests.daemon.fakes import ByteTokenizer
from tests.daemon.harness import running_server


class GatedTokenizer(ByteTokenizer):
    """Renders wait on `release` once they have polled; records concurrency and the poll hooks."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.hooks: list[str] = []

    def render_chat(self, messages, *, add_generation_prompt=True, tools=None, should_stop=None):
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.hooks.append(type(should_stop).__name__)
        try:
            if len(messages) > HEAVY_MESSAGES:
                self.release.wait(30)
            return super().render_chat(messages, add_generation_prompt=add_generation_prompt)
        finally:
            with self.lock:
                self.running -= 1


def _chat(n: int) -> list[dict]:
    return [{"role": "user", "content": "hi"} for _ in range(n)]


async def test_one_heavy_render_at_a_time_while_a_light_one_goes_through(tmp_path):
    tokenizer = GatedTokenizer()
    async with running_server(tmp_path, bounds=ConnectionBounds(max_heavy_jobs=1, render_process=False)) as server:
        server._runtime = dataclasses.replace(server._runtime, tokenizer=tokenizer)  # noqa: SLF001
        heavy = _chat(HEAVY_MESSAGES + 1)
        async with await AsyncClient.connect(server.socket_path) as a, \
                await AsyncClient.connect(server.socket_path) as b, \
                await AsyncClient.connect(server.socket_path) as c:
            async with anyio.create_task_group() as tg:
                replies: dict[str, object] = {}

                async def tokenize(name, client, messages):
                    replies[name] = await client.tokenize(messages=messages)

                tg.start_soon(tokenize, "a", a, heavy)
                with anyio.fail_after(30):  # liveness bounds only
                    while tokenizer.running < 1:
                        await anyio.sleep(0.01)
                tg.start_soon(tokenize, "b", b, heavy)
                await tokenize("c", c, _chat(2))  # light: not behind the heavy gate
                assert set(replies) == {"c"} and tokenizer.running == 1
                tokenizer.release.set()
        assert tokenizer.peak == 2  # a heavy one and the light one, never two heavy ones
        assert tokenizer.hooks == ["CpuShare", "PeerProbe", "CpuShare"]
        assert server.host_work.num_running == 0
        assert replies["a"].ids == replies["b"].ids != replies["c"].ids


def test_cpu_share_sleeps_to_keep_the_share_between_polls():
    cpu = iter([0.0, 0.004, 0.004 + SLICE_S, 0.020, 0.021, 0.021 + 2 * SLICE_S, 0.05])
    slept: list[float] = []
    share = CpuShare(0.25, lambda: False, sleep=slept.append, cpu_s=lambda: next(cpu))
    assert [share() for _ in range(4)] == [False] * 4
    # Polls at 0, 0.004 (under a slice), 0.014 (a slice used: sleep 3x it), then from 0.020.
    assert slept == [(0.004 + SLICE_S) * 3]
    assert abs(share.slept_s - slept[0]) < 1e-12


def test_heaviness_is_judged_from_counts_and_lengths():
    assert not is_heavy({"messages": _chat(HEAVY_MESSAGES)})
    assert is_heavy({"messages": _chat(HEAVY_MESSAGES + 1)})
    assert is_heavy({"messages": [{"role": "user", "content": "x" * (64 << 10)}, {"role": "user", "content": "y"}]})
    assert is_heavy({"prompt": "x" * ((64 << 10) + 1)})
    assert not is_heavy({"tokens": list(range(100_000))})


async def test_a_heavy_request_whose_client_leaves_while_it_waits_never_runs(tmp_path):
    tokenizer = GatedTokenizer()
    async with running_server(tmp_path, bounds=ConnectionBounds(max_heavy_jobs=1, render_process=False)) as server:
        server._runtime = dataclasses.replace(server._runtime, tokenizer=tokenizer)  # noqa: SLF001
        work = server.host_work
        heavy = _chat(HEAVY_MESSAGES + 1)
        async with await AsyncClient.connect(server.socket_path) as a:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: a.tokenize(messages=heavy))
                with anyio.fail_after(30):  # liveness bounds only
                    while tokenizer.running < 1:
                        await anyio.sleep(0.01)
                    async with await FramedStream.connect(server.socket_path) as leaver:
                        await leaver.send({"type": "tokenize", "id": 1, "messages": heavy})
                        while work.num_waiting < 1:
                            await anyio.sleep(0.01)
                    while work.num_waiting:  # it leaves the queue while a's render still runs
                        await anyio.sleep(0.01)
                assert tokenizer.running == 1
                tokenizer.release.set()
        assert tokenizer.hooks == ["CpuShare"]  # the leaver's render never started
        assert work.num_running == 0
