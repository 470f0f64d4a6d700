"""Abandoned generates (prefixd/front/abandon.py): a client that keeps leaving the work it
asked for waits, while another client is served, before its next generates are seated.

Through the socket, the abandoning client is another process: its connections are opened by
a child (so SO_PEERCRED names the child) and handed to the test over SCM_RIGHTS. Then the
ledger and the seat order on their own.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import anyio
import pytest

from prefixd.front.abandon import HOLD_BASE_S, POLL_S, AbandonLedger, AbandonLimits
from prefixd.front.bounds import ConnectionBounds
from prefixd.front.fair import FairSeats
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.transport import FramedStream
from tests.daemon.fakes import LetterDevice
from tests.daemon.harness import running_server, wait_idle

_CHILD = """
import socket, sys
path, back, count = sys.argv[1], socket.socket(fileno=int(sys.argv[2])), int(sys.argv[3])
conns = [socket.socket(socket.AF_UNIX) for _ in range(count)]
for conn in conns:
    conn.connect(path)
socket.send_fds(back, [b"x"], [conn.fileno() for conn in conns])
"""


def _connections_of_another_process(path: str, count: int) -> list[socket.socket]:
    """`count` connections to `path` whose peer (SO_PEERCRED) is one child process."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        subprocess.run([sys.executable, "-c", _CHILD, path, str(theirs.fileno()), str(count)],
                       pass_fds=(theirs.fileno(),), check=True, timeout=60)
        _, fds, _, _ = socket.recv_fds(ours, 1, count)
    assert len(fds) == count
    return [socket.socket(fileno=fd) for fd in fds]


async def _client(sock: socket.socket) -> AsyncClient:
    return AsyncClient(FramedStream(await anyio.abc.UNIXSocketStream.from_socket(sock)))


async def _wait_for(predicate) -> None:
    with anyio.fail_after(30):  # a liveness bound, not a timing assertion
        while not predicate():
            await anyio.sleep(0.01)


def _abandoning_server(tmp_path, device):
    # grace 0 and a ten-minute cap: twelve abandons hold the client far past the test's bounds,
    # so a held generate that finishes was let go because no other client was left
    limits = AbandonLimits(grace=0, hold_max_s=600.0)
    return running_server(tmp_path, device, bounds=ConnectionBounds(abandon=limits))


async def test_a_client_that_keeps_abandoning_waits_while_another_is_served_and_not_alone(tmp_path):
    device = LetterDevice(num_lanes=2, round_delay_s=0.02)  # a stream abandoned after a token still runs
    async with _abandoning_server(tmp_path, device) as server:
        path = str(server.socket_path)
        async with await AsyncClient.connect(path) as honest:  # cache off: the fake's stored rows are no letters
            solo = await honest.generate(prompt="later", max_tokens=6, cache=False).collect()
            honest_solo = await honest.generate(prompt="honest", max_tokens=40, cache=False).collect()
        hostile_socks = await anyio.to_thread.run_sync(_connections_of_another_process, path, 3)
        ledger, seats = server.gate.abandons, server.gate.seats  # noqa: SLF001 - the test watches the queue
        async with await _client(hostile_socks[0]) as hostile:
            for k in range(12):  # read a token, cancel: alone on the daemon, never held
                stream = await hostile.generate(prompt=f"left{k}", max_tokens=200).start()
                async for _ in stream:
                    break
                await stream.cancel()  # 200 slow rounds: it is still running
                assert (await stream.collect()).finish_reason == "cancelled"
        assert ledger.abandoned == 12 and ledger.holds == 0
        (peer,) = ledger._clients  # noqa: SLF001 - the child's (pid, uid)
        assert ledger.hold_left_s(peer) > 60

        async with await AsyncClient.connect(path) as honest, await _client(hostile_socks[1]) as hostile:
            device.gate.clear()  # the honest stream holds its seat in a parked round
            running = await honest.generate(prompt="honest", max_tokens=40, cache=False).start()
            await _wait_for(lambda: seats.num_free == 1)
            held = await hostile.generate(prompt="later", max_tokens=6, cache=False).start()
            await _wait_for(lambda: ledger.holds == 1)
            assert seats.num_free == 1  # held before its seat, although one is free
            assert ledger.stats()["clients_held"] == 1
            device.gate.set()
            honest_result = await running.collect()
            assert (honest_result.finish_reason, honest_result.ids) == ("length", honest_solo.ids)  # unchanged beside it
            with anyio.fail_after(30):  # its hold has ~10 minutes left: only the honest client's end lets it go
                result = await held.collect()
            assert (result.finish_reason, result.ids, result.text) == (solo.finish_reason, solo.ids, solo.text)
            # alone again: its next generate is not held, though its hold has not passed
            assert ledger.hold_left_s(peer) > 60
            again = await hostile.generate(prompt="later", max_tokens=6, cache=False).collect()
            assert again.ids == solo.ids and ledger.holds == 1
        await wait_idle(server)
        assert seats.num_free == 2 and seats.num_waiting == 0
        hostile_socks[2].close()


async def test_a_held_generate_can_be_cancelled_and_a_hang_up_counts_its_streams(tmp_path):
    device = LetterDevice(num_lanes=2, round_delay_s=0.02)  # a stream abandoned after a token still runs
    async with _abandoning_server(tmp_path, device) as server:
        path = str(server.socket_path)
        ledger, seats = server.gate.abandons, server.gate.seats  # noqa: SLF001
        socks = await anyio.to_thread.run_sync(_connections_of_another_process, path, 2)
        framed = FramedStream(await anyio.abc.UNIXSocketStream.from_socket(socks[0]))
        async with framed:  # two generates, a token read, then a hang-up with both in flight
            for i in (1, 2):
                await framed.send({"type": "generate", "id": i, "prompt": "gone", "max_tokens": 200})
            seen: set[int] = set()
            while seen != {1, 2}:
                event = await framed.receive()
                if event.get("type") == "token":
                    seen.add(event["id"])
            device.gate.clear()  # both still running when the client goes
        await _wait_for(lambda: ledger.abandoned == 2)
        device.gate.set()
        await wait_idle(server)

        async with await AsyncClient.connect(path) as honest, await _client(socks[1]) as hostile:
            device.gate.clear()
            running = await honest.generate(prompt="honest", max_tokens=40).start()
            await _wait_for(lambda: seats.num_free == 1)
            held = await hostile.generate(prompt="held", max_tokens=6).start()
            await _wait_for(lambda: ledger.holds == 1)
            await held.cancel()
            with anyio.fail_after(30):
                cancelled = await held.collect()
            assert cancelled.finish_reason == "cancelled" and cancelled.text == ""
            assert ledger.abandoned == 2  # cancelled before it reached the engine: no charge
            device.gate.set()
            assert (await running.collect()).finish_reason == "length"
        await wait_idle(server)
        assert seats.num_free == 2 and seats.num_waiting == 0


def test_the_ledger_holds_past_the_grace_doubling_to_the_cap_and_drains():
    now = [0.0]
    limits = AbandonLimits(grace=2, drain_per_s=0.5, hold_max_s=3.0)
    ledger = AbandonLedger(limits, clock=lambda: now[0])
    ledger.abandon("p", 2)
    assert ledger.level("p") == 2 and ledger.hold_left_s("p") == 0  # within the grace
    ledger.abandon("p")
    assert ledger.hold_left_s("p") == HOLD_BASE_S  # level 3: the first hold
    ledger.abandon("p")
    assert ledger.hold_left_s("p") == 2 * HOLD_BASE_S
    ledger.abandon("p", 5)
    assert ledger.hold_left_s("p") == 3.0  # the cap
    assert ledger.hold_left_s("q") == 0 and ledger.level("q") == 0  # by client
    now[0] = 4.0
    assert ledger.level("p") == 9 - 4 * 0.5 and ledger.hold_left_s("p") == 0
    assert ledger.stats()["clients_held"] == 0
    now[0] = 30.0
    ledger.abandon("q")
    assert "p" not in ledger._clients  # noqa: SLF001 - drained and past its hold: forgotten
    assert AbandonLimits(hold_max_s=0).hold_s(100) == 0  # 0: never held
    with pytest.raises(ValueError):
        AbandonLimits(drain_per_s=0)


def test_past_its_grace_a_client_goes_one_generate_at_a_time_once_its_hold_has_passed():
    now = [0.0]
    ledger = AbandonLedger(AbandonLimits(grace=2, drain_per_s=0.1, hold_max_s=1.0), clock=lambda: now[0])
    ledger.abandon("p", 4)
    assert ledger.held("p", seated=0) == 1.0  # the hold first
    now[0] = 2.0  # the hold has passed; level 3.8, still past the grace
    assert ledger.held("p", seated=0) == 0  # one may go
    assert ledger.held("p", seated=1) == POLL_S  # the next waits for it
    now[0] = 20.0  # drained to the grace: any number again
    assert ledger.held("p", seated=3) == 0
    assert AbandonLedger(AbandonLimits(grace=0, hold_max_s=0)).held("q", seated=5) == 0  # holds off


async def test_a_held_wait_ends_when_no_other_client_is_active():
    ledger = AbandonLedger(AbandonLimits(grace=0, hold_max_s=600.0))
    ledger.abandon("p", 12)
    await ledger.wait("p", lambda: False)  # nobody else: at once
    assert ledger.holds == 0
    checks = iter([True, True, False])
    with anyio.fail_after(30):
        await ledger.wait("p", lambda: next(checks))
    assert ledger.holds == 1 and ledger.hold_left_s("p") > 60


async def test_seats_are_fair_across_clients_first_then_across_a_clients_connections():
    seats = FairSeats(3)
    order: list[str] = []

    async def take(owner, label: str) -> None:
        await seats.take(owner)
        order.append(label)

    # client P holds two seats through connection a, client Q one through c
    for owner in (("P", "a"), ("P", "a"), ("Q", "c")):
        await seats.take(owner)
    assert seats.others_active(("P", "b")) and seats.others_active(("R", "x"))
    async with anyio.create_task_group() as tg:
        for k, (owner, label) in enumerate(((("P", "b"), "Pb"), (("Q", "d"), "Qd"))):
            tg.start_soon(take, owner, label)
            await _wait_for(lambda: seats.num_waiting == k + 1)
        for k, owner in enumerate((("Q", "c"), ("P", "a"))):
            seats.give_back(owner)
            await _wait_for(lambda: len(order) == k + 1)
    # Pb and Qd are new connections holding nothing, Pb queued first; but client P holds two
    # seats and Q none once c is given back, so Qd goes first (by connection alone, Pb would)
    assert order == ["Qd", "Pb"]
    assert seats.held_by(("P", "b")) == 1 and seats.held_by("P") == 2 and seats.held_by(("Q", "d")) == 1
    seats.give_back(("Q", "d"))
    assert not seats.others_active(("P", "z")) and seats.others_active(("Q", "d"))
