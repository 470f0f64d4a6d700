"""Fair seating: a connection holding fewer lanes is seated before one holding more.

Through the socket, on a 2-lane engine: connection A holds both lanes and queues a third
generate; connection B queues one after it. When A's first stream ends, B is seated before
A's third (max-min), although A's waited longer. Then the FairSeats order on its own.
"""

from __future__ import annotations

import threading

import anyio
import pytest

from prefixd.front import gate as gate_module
from prefixd.front.fair import FairSeats
from prefixd.front.requests import RequestBuilder
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.transport import FramedStream
from tests.daemon.fakes import LetterDevice
from tests.daemon.harness import running_server, wait_idle


class PrefillOrderDevice(LetterDevice):
    """Records the prompt of every first prefill chunk, in the order rounds run them."""

    def __init__(self) -> None:
        super().__init__(num_lanes=2)
        self.first_chunks: list[str] = []

    def run_round(self, plan):
        self.first_chunks.extend(bytes(t - 3 for t in w.tokens).decode() for w in plan.lanes
                                 if w.prefill and w.start == 0)
        return super().run_round(plan)


async def _wait_for(predicate) -> None:
    with anyio.fail_after(30):  # a liveness bound, not a timing assertion
        while not predicate():
            await anyio.sleep(0.01)


async def test_a_connection_holding_no_lane_is_seated_before_one_holding_lanes(tmp_path):
    device = PrefillOrderDevice()
    async with running_server(tmp_path, device) as server:
        seats = server.gate.seats  # noqa: SLF001 - the test watches the queue it orders
        async with await AsyncClient.connect(server.socket_path) as a, \
                await AsyncClient.connect(server.socket_path) as b:
            device.gate.clear()  # the engine parks in its first round: nothing finishes yet
            a1 = await a.generate(prompt="a1", max_tokens=2).start()
            a2 = await a.generate(prompt="a2", max_tokens=40).start()
            a3 = await a.generate(prompt="a3", max_tokens=2).start()
            await _wait_for(lambda: seats.num_waiting == 1)
            b1 = await b.generate(prompt="b1", max_tokens=2).start()
            await _wait_for(lambda: seats.num_waiting == 2)
            device.gate.set()
            results = [await s.collect() for s in (a1, a2, a3, b1)]
        assert [r.finish_reason for r in results] == ["length"] * 4
        assert [r.text for r in results] == ["bc", "bcdefghijklmnopqrstuvwxyzabcdefghijklmno", "bc", "bc"]
        assert device.first_chunks == ["a1", "a2", "b1", "a3"]  # first come, first served would seat a3 before b1
        await wait_idle(server)
        assert seats.num_free == 2 and seats.num_waiting == 0


async def test_generates_on_one_connection_take_seats_in_the_order_sent_whichever_build_ends_first(
        tmp_path, monkeypatch):
    """A connection's generates are built in worker threads (all but the smallest: here none
    is small enough for the loop), so a later one's build may end first; it still waits for
    the earlier one to ask for its seat. Here the first build is held until the second's has
    ended: the second must not be seated before it."""
    monkeypatch.setattr(gate_module, "INLINE_CHARS", -1)
    second_built = threading.Event()
    build = RequestBuilder.generate

    def held_build(self, msg, *args, **kwargs):
        if msg.get("prompt") == "first":
            assert second_built.wait(30)  # a liveness bound: the second build ends meanwhile
        try:
            return build(self, msg, *args, **kwargs)
        finally:
            if msg.get("prompt") == "second":
                second_built.set()

    monkeypatch.setattr(RequestBuilder, "generate", held_build)
    device = PrefillOrderDevice()
    async with running_server(tmp_path, device) as server:
        async with await AsyncClient.connect(server.socket_path) as a:
            first = await a.generate(prompt="first", max_tokens=2).start()
            second = await a.generate(prompt="second", max_tokens=2).start()
            results = [await s.collect() for s in (first, second)]
        assert [r.finish_reason for r in results] == ["length"] * 2
        assert device.first_chunks[:2] == ["first", "second"]
        await wait_idle(server)


async def test_cancelling_a_generate_that_waits_for_a_seat_ends_it_at_once(tmp_path):
    device = LetterDevice(num_lanes=1)
    async with running_server(tmp_path, device) as server:
        seats = server.gate.seats  # noqa: SLF001
        async with await AsyncClient.connect(server.socket_path) as a:
            device.gate.clear()
            held = await a.generate(prompt="held", max_tokens=2).start()
            queued = await a.generate(prompt="queued", max_tokens=2).start()
            await _wait_for(lambda: seats.num_waiting == 1)
            await queued.cancel()
            with anyio.fail_after(30):  # a liveness bound: the only lane is still parked
                cancelled = await queued.collect()
            assert cancelled.finish_reason == "cancelled" and cancelled.text == ""
            assert seats.num_waiting == 0
            device.gate.set()
            assert (await held.collect()).text == "de"
        await wait_idle(server)
        assert seats.num_free == 1


async def test_seats_go_to_the_owner_holding_fewest_then_to_the_longest_waiting():
    seats = FairSeats(2)
    order: list[str] = []

    async def take(owner: str, label: str) -> None:
        await seats.take(owner)
        order.append(label)

    await seats.take("a")
    await seats.take("a")
    async with anyio.create_task_group() as tg:
        for k, (owner, label) in enumerate((("a", "a3"), ("b", "b1"), ("c", "c1"), ("b", "b2"))):
            tg.start_soon(take, owner, label)
            await _wait_for(lambda: seats.num_waiting == k + 1)  # queued in this order
        for k, owner in enumerate(("a", "a", "b", "a")):
            seats.give_back(owner)
            await _wait_for(lambda: len(order) == k + 1)
    # a holds 1, b and c none: b1 (queued before c1); then a, b, c hold 0, 1, 0: a3, the oldest;
    # then b holds 0 again: c1 before b2, queued later; then b2.
    assert order == ["b1", "a3", "c1", "b2"]
    assert seats.held_by("a") == 0 and seats.held_by("b") == 1 and seats.held_by("c") == 1
    with pytest.raises(RuntimeError):
        seats.give_back("a")


async def test_a_generate_whose_client_leaves_while_its_submit_waits_is_cancelled_in_the_engine(tmp_path):
    """The client leaves while its generate's submit waits for the engine (parked in a round):
    the stream is submitted after all, and must then be cancelled, not run to max_tokens for
    nobody while it holds a lane."""
    device = LetterDevice()
    async with running_server(tmp_path, device) as server:
        host = server.link  # noqa: SLF001 - the test watches the streams the host routes
        async with await AsyncClient.connect(server.socket_path) as holder:
            device.gate.clear()
            held = await holder.generate(prompt="hold", max_tokens=1).start()
            await _wait_for(lambda: device.waiting)
            async with await FramedStream.connect(server.socket_path) as leaver:
                await leaver.send({"type": "generate", "id": 1, "prompt": "orphan", "max_tokens": 100})
                await _wait_for(lambda: len(host._sinks) == 2)  # noqa: SLF001 - its submit is queued
            await _wait_for(lambda: len(host._sinks) == 1)  # noqa: SLF001 - the connection let go of it
            device.gate.set()
            assert (await held.collect()).finish_reason == "length"
        status = await wait_idle(server)
    assert max(lane["rows"] for lane in status["lanes"]) <= len("orphan") + 2  # cut off, not 100 tokens
