"""Overlap in the engine loop (engine/process.py), through the engine link: while a round's device call runs on the device thread, submits
and cancels run and the next round's streams are seated; every other call waits for the round
to land; a device that fails mid-round still ends every stream with an error."""

from __future__ import annotations

import threading

import anyio
import pytest

from prefixd.engine.runtime import Runtime
from prefixd.front.engine_link import EngineLink, ThreadLauncher
from prefixd.scheduler.config import SchedulerConfig
from prefixd.scheduler.engine import Engine
from prefixd.scheduler.streams import DoneEvent, StreamRequest
from tests.daemon.fakes import ByteTokenizer
from tests.scheduler.fake_device import FakeDevice, make_info, reference_tokens


async def overlapped(engine: Engine) -> EngineLink:
    """A started link to `engine` served by the engine loop with overlap on."""
    runtime = Runtime(engine=engine, tokenizer=ByteTokenizer(), model_info={}, overlap=True)
    link = EngineLink(ThreadLauncher(lambda cfg, observer: runtime))
    await link.start()
    return link


class GatedDevice(FakeDevice):
    """A fake device whose rounds wait for the test's go, and which records the thread that ran
    each round and whether a round was running when the engine was read."""

    def __init__(self, info) -> None:
        super().__init__(info)
        self.go = threading.Event()
        self.in_round = threading.Event()
        self.threads: set[str] = set()
        self.gated = True

    def run_round(self, plan):
        self.threads.add(threading.current_thread().name)
        self.in_round.set()
        try:
            if self.gated:
                assert self.go.wait(30), "the test never let the round go"
                self.go.clear()
            return super().run_round(plan)
        finally:
            self.in_round.clear()


async def collect(receive) -> tuple[list[int], DoneEvent]:
    ids: list[int] = []
    async for event in receive:
        if isinstance(event, DoneEvent):
            return ids, event
        ids.extend(event.ids)
    raise AssertionError("the stream ended without its done event")


async def wait_for(flag: threading.Event) -> None:
    await wait_until(flag.is_set)


async def wait_until(done) -> None:
    with anyio.fail_after(30):
        while not done():
            await anyio.sleep(0.001)


def seated_ahead(engine: Engine) -> set[int]:
    ahead = engine._ahead
    return set() if ahead is None else {s.stream.stream_id for s in ahead._seatings.values()}


@pytest.fixture
def gated():
    device = GatedDevice(make_info(num_lanes=2, num_pages=32))
    return device, Engine(device, SchedulerConfig(num_lanes=2, grid=4))


async def test_a_request_arriving_mid_round_is_seated_before_that_round_lands(gated):
    device, engine = gated
    host = await overlapped(engine)
    first = await host.submit(StreamRequest(1, tuple(range(10, 19)), 3))
    await wait_for(device.in_round)  # round 1 is on the device thread and held there
    second = await host.submit(StreamRequest(2, tuple(range(40, 47)), 3))  # runs beside it
    await wait_until(lambda: 2 in seated_ahead(engine))  # seated for the next round, on the engine thread
    assert len(device.plans) == 0 and device.in_round.is_set()  # still the first round, unlanded

    status = None

    async def read_status() -> None:
        nonlocal status
        status = await host.status()  # not host-only: waits for the round to land

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_status)
        await anyio.sleep(0.05)
        assert status is None, "a call that may touch the device ran while a round was in flight"
        device.gated = False
        device.go.set()
    assert status is not None
    (ids1, done1), (ids2, done2) = await collect(first), await collect(second)
    await host.stop()
    assert ids1 == reference_tokens(range(10, 19), 3) and ids2 == reference_tokens(range(40, 47), 3)
    assert (done1.finish_reason, done2.finish_reason) == ("length", "length")
    assert device.threads == {"prefixd-device_0"}  # every round ran on the device thread
    engine.check_integrity()


async def test_a_cancel_mid_round_lands_after_it_and_frees_the_lane(gated):
    device, engine = gated
    host = await overlapped(engine)
    first = await host.submit(StreamRequest(1, tuple(range(10, 19)), 50))
    await wait_for(device.in_round)
    host.cancel_nowait(1)
    device.gated = False
    device.go.set()
    ids, done = await collect(first)
    assert done.finish_reason == "cancelled" and len(ids) < 50
    await host.stop()
    engine.check_integrity()
    assert all(not lane.busy for lane in engine.lanes)


async def test_a_device_failing_mid_round_ends_every_stream_and_the_host_serves_on(gated):
    device, engine = gated
    device.gated = False
    fail = threading.Event()
    real = device.run_round

    def run_round(plan):
        if fail.is_set():
            fail.clear()
            raise RuntimeError("device lost")
        return real(plan)

    device.run_round = run_round
    host = await overlapped(engine)
    fail.set()
    ids, done = await collect(await host.submit(StreamRequest(1, tuple(range(10, 19)), 3)))
    assert (ids, done.finish_reason) == ([], "error") and "device lost" in done.note
    ids, done = await collect(await host.submit(StreamRequest(2, tuple(range(10, 19)), 3)))
    assert (ids, done.finish_reason) == (reference_tokens(range(10, 19), 3), "length")
    assert (await host.status())["failed_rounds"] == 1
    await host.stop()
    engine.check_integrity()
