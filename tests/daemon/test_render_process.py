"""Heavy chat renders run in the render process, not in the daemon's interpreter: the reply
is the same, the render's exceptions come back as themselves, a client that leaves cancels
it, a child that dies is replaced, and none outlives the daemon. A client that keeps the
child busy has its renders run at idle priority."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import anyio
import pytest

from prefixd.front.bounds import ConnectionBounds
from prefixd.daemon.host_work import HEAVY_MESSAGES
from prefixd.daemon.render_process import ClientRenderer, RenderFailed, RenderPool, RenderShares
from prefixd.gpu.threads import CpuThreads
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.errors import ProtocolError
from prefixd.text.chat import ChatTemplateError, RenderCancelled
from tests.daemon.fakes import ByteTokenizer, LetterDevice, fake_runtime_factory
from tests.daemon.harness import running_server


class PidTokenizer(ByteTokenizer):
    """Renders as ByteTokenizer, with the rendering process's pid in front of the text."""

    def render_chat(self, messages, *, add_generation_prompt=True, tools=None, should_stop=None):
        return super().render_chat([{"role": "pid", "content": str(os.getpid())}, *messages],
                                   add_generation_prompt=add_generation_prompt)


class TrickyTokenizer(ByteTokenizer):
    """A role names what the render does: fail, wait for its cancel, or kill its process
    (once, while `die_once` exists, or always)."""

    def __init__(self, die_once: Path | None = None) -> None:
        self.die_once = die_once

    def render_chat(self, messages, *, add_generation_prompt=True, tools=None, should_stop=None):
        role = messages[0]["role"]
        if role == "fail":
            raise ChatTemplateError("this template takes no 'fail' role")
        if role == "wait":
            for _ in range(3000):  # a liveness bound: 30 s
                if should_stop is not None and should_stop():
                    raise RenderCancelled("the render was abandoned: its client has gone")
                time.sleep(0.01)
        if role == "policy":  # the scheduling policy of the thread rendering
            messages = [{"role": "policy", "content": str(os.sched_getscheduler(0))}]
        if role == "busy":
            end = time.thread_time() + 0.05
            while time.thread_time() < end:
                pass
        if role == "die" or (role == "die_once" and self.die_once is not None and self.die_once.exists()):
            if self.die_once is not None:
                self.die_once.unlink(missing_ok=True)
            os._exit(3)
        return super().render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)


@pytest.fixture
def pool():
    pool = RenderPool(cpu_share=1.0)
    pool.start()
    yield pool
    pool.close()


def test_the_render_process_renders_what_the_daemon_would(pool):
    tokenizer = ByteTokenizer()
    pool.bind(tokenizer)
    messages = [{"role": "user", "content": f"m{i}"} for i in range(300)]
    assert pool.render(messages) == tokenizer.render_chat(messages)
    assert pool.render(messages, add_generation_prompt=False) == tokenizer.render_chat(messages, add_generation_prompt=False)


def test_a_render_error_comes_back_as_itself(pool):
    pool.bind(TrickyTokenizer())
    with pytest.raises(ChatTemplateError, match="no 'fail' role"):
        pool.render([{"role": "fail", "content": ""}])
    assert pool.render([{"role": "user", "content": "x"}]).text.startswith("<user>x")  # the child serves on
    assert pool.started == 1


def test_a_caller_that_stops_cancels_the_render_in_the_child(pool):
    pool.bind(TrickyTokenizer())
    asked = time.monotonic() + 0.2
    with pytest.raises(RenderCancelled):
        pool.render([{"role": "wait", "content": ""}], should_stop=lambda: time.monotonic() > asked)
    assert pool.render([{"role": "user", "content": "x"}]).text.startswith("<user>x")
    assert pool.started == 1


def test_a_render_in_the_child_holds_a_core_until_it_ends(pool):
    """What the engine's thread policy reads (CpuThreads.held_cores): 1 while a render runs in
    the child at normal priority, whether it returns, fails or is cancelled; 0 otherwise."""
    pool.bind(TrickyTokenizer())
    assert pool.cores_in_use() == 0
    seen: list[int] = []

    def stop() -> bool:
        seen.append(pool.cores_in_use())
        return len(seen) > 3

    with pytest.raises(RenderCancelled):
        pool.render([{"role": "wait", "content": ""}], should_stop=stop)
    assert set(seen) == {1}
    assert pool.cores_in_use() == 0
    with pytest.raises(ChatTemplateError):
        pool.render([{"role": "fail", "content": ""}])
    assert pool.cores_in_use() == 0
    seen.clear()  # a client past its share renders at idle priority: it holds no core
    with pytest.raises(RenderFailed):  # render_timed carries the cancel with its CPU time
        pool.render_timed([{"role": "wait", "content": ""}], should_stop=stop, idle=True)
    assert set(seen) == {0}


def test_a_child_that_dies_during_a_render_is_replaced_and_the_render_runs_again(pool, tmp_path):
    marker = tmp_path / "die-once"
    marker.touch()
    pool.bind(TrickyTokenizer(die_once=marker))
    first = pool.pid
    rendered = pool.render([{"role": "die_once", "content": "x"}])
    assert rendered.text.startswith("<die_once>x") and not marker.exists()
    assert pool.started == 2 and pool.pid != first


def test_a_render_that_kills_its_process_twice_is_an_internal_error(pool):
    pool.bind(TrickyTokenizer())
    with pytest.raises(ProtocolError) as err:
        pool.render([{"role": "die", "content": ""}])
    assert err.value.code.value == "internal"
    assert pool.render([{"role": "user", "content": "x"}]).text.startswith("<user>x")  # a third child serves
    assert pool.started == 3


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
def test_an_idle_render_runs_under_sched_idle_and_the_next_one_does_not(pool):
    pool.bind(TrickyTokenizer())
    policy = [{"role": "policy", "content": ""}]
    idle, _ = pool.render_timed(policy, idle=True)
    plain, _ = pool.render_timed(policy)
    assert f"<policy>{os.SCHED_IDLE}" in idle.text
    assert f"<policy>{os.SCHED_OTHER}" in plain.text  # SCHED_IDLE ended with its job's thread
    assert pool.started == 1


def test_a_render_reports_its_cpu_time_and_so_does_one_that_fails(pool):
    pool.bind(TrickyTokenizer())
    _, busy_s = pool.render_timed([{"role": "busy", "content": ""}])
    assert busy_s >= 0.05
    with pytest.raises(RenderFailed) as failed:
        pool.render_timed([{"role": "fail", "content": ""}])
    assert isinstance(failed.value.error, ChatTemplateError) and failed.value.cpu_s >= 0


class RecordingPool:
    def __init__(self) -> None:
        self.idle: list[bool] = []

    def render_timed(self, messages, *, should_stop=None, idle=False, **kwargs):
        self.idle.append(idle)
        if messages[0]["role"] == "fail":
            raise RenderFailed(ChatTemplateError("no"), 0.4)
        return "rendered", 0.3


def test_a_client_over_its_render_share_renders_idle_until_its_charge_drains():
    now = [0.0]
    shares = RenderShares(grace_s=0.5, per_s=0.1, clock=lambda: now[0])
    pool = RecordingPool()
    busy, other = ClientRenderer(pool, shares, "busy"), ClientRenderer(pool, shares, "other")
    chat = [{"role": "user", "content": "x"}]
    assert busy.render(chat) == "rendered" and busy.render(chat) == "rendered"  # 0.6 charged
    with pytest.raises(ChatTemplateError):  # a failed render is charged too (1.0), and raises as itself
        busy.render([{"role": "fail", "content": ""}])
    busy.render(chat)
    other.render(chat)
    assert pool.idle == [False, False, True, True, False]  # over 0.5 from the third; by client
    assert shares.idle_renders == 2
    now[0] = 9.0  # 1.3 - 0.9 drained: 0.4, under the grace again
    busy.render(chat)
    assert pool.idle[-1] is False and shares.charge("busy") == pytest.approx(0.7)
    now[0] = 100.0
    shares.add("new", 0.0)
    assert shares.charge("busy") == 0 and "busy" not in shares._charges  # noqa: SLF001 - drained: forgotten


def test_closing_the_pool_ends_its_child():
    pool = RenderPool(cpu_share=1.0)
    pool.start()
    pid = pool.pid
    pool.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # exited and reaped


async def test_a_heavy_socket_render_runs_in_the_render_process_and_a_light_one_in_the_daemon(tmp_path):
    tokenizer = PidTokenizer()
    async with running_server(tmp_path, bounds=ConnectionBounds()) as server:
        server._runtime = dataclasses.replace(server._runtime, tokenizer=tokenizer)  # noqa: SLF001
        server.renderer.bind(tokenizer)
        child = server.renderer.pid
        assert child is not None and child != os.getpid()
        heavy = [{"role": "user", "content": "hi"} for _ in range(HEAVY_MESSAGES + 1)]
        async with await AsyncClient.connect(server.socket_path) as client:
            heavy_text = tokenizer.decode((await client.tokenize(messages=heavy)).ids)
            light_text = tokenizer.decode((await client.tokenize(messages=heavy[:2])).ids)
        assert heavy_text == f"<pid>{child}\n" + "<user>hi\n" * (HEAVY_MESSAGES + 1) + "<assistant>"
        assert light_text.startswith(f"<pid>{os.getpid()}\n")
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # the daemon's shutdown ended it


async def test_the_engines_thread_policy_leaves_a_core_to_a_render_running_in_the_child(tmp_path):
    """Wiring: the daemon hands its engine's CPU thread policy the render pool's held cores, so
    the team runs one thread on 2 cores while a render runs, and both again after it."""
    device = LetterDevice()
    threads = CpuThreads(2, num_cores=2, sample=lambda: None, set_threads=lambda n: None)
    base = fake_runtime_factory(device)

    def factory(cfg, observer):
        return dataclasses.replace(base(cfg, observer), before_round=threads.tick, cpu_threads=threads)

    async with running_server(tmp_path, device, bounds=ConnectionBounds(), runtime_factory=factory) as server:
        server.renderer.bind(TrickyTokenizer())
        seen: list[int] = []

        def stop() -> bool:
            seen.append(threads.tick())
            return len(seen) > 3

        with pytest.raises(RenderCancelled):
            await anyio.to_thread.run_sync(lambda: server.renderer.render([{"role": "wait", "content": ""}],
                                                                           should_stop=stop))
        assert set(seen) == {1}
        assert threads.tick() == 2


def test_a_tokenizer_that_cannot_be_pickled_renders_in_the_calling_thread(pool):
    import threading

    class Unpicklable(ByteTokenizer):
        def __init__(self) -> None:
            self.lock = threading.Lock()  # cannot be pickled

    pool.bind(Unpicklable())
    assert pool.render([{"role": "user", "content": "x"}]).text.startswith("<user>x")


def test_a_child_that_cannot_be_started_leaves_the_render_to_the_calling_thread(monkeypatch):
    from prefixd.daemon import render_process

    def no_process(cls, cpu_share):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(render_process._Child, "spawn", classmethod(no_process))
    pool = RenderPool(cpu_share=1.0)
    pool.start()  # logged, not raised: the daemon starts without it
    tokenizer = PidTokenizer()
    pool.bind(tokenizer)
    assert pool.pid is None
    assert pool.render([{"role": "user", "content": "x"}]).text.startswith(f"<pid>{os.getpid()}\n")
    pool.close()
