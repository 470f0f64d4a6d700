"""Client pacing (prefixd/front/pacing.py), through the socket: a client that floods the
daemon with frames, errors or connections is read at its budget's pace; nothing it sent is
dropped, and other clients are not slowed by its debt."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import anyio

from prefixd.front.bounds import ConnectionBounds
from prefixd.front.pacing import PaceLimits
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.framing import encode_frame
from prefixd.ipc.transport import FramedStream
from tests.daemon.harness import running_server, wait_idle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Another process (the daemon keys budgets by peer process): writes N detokenize frames in
# one write, reads every reply, prints the ids in the order they came.
_FLOOD = textwrap.dedent("""
    import socket, struct, sys
    import msgpack
    n = int(sys.argv[2])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    body = lambda i: msgpack.packb({"type": "detokenize", "id": i, "ids": [100]})
    sock.sendall(b"".join(struct.pack(">I", len(body(i))) + body(i) for i in range(n)))
    print("sent", flush=True)
    buf, ids = b"", []
    while len(ids) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
            size = struct.unpack(">I", buf[:4])[0]
            ids.append(msgpack.unpackb(buf[4:4 + size])["id"])
            buf = buf[4 + size:]
    print(" ".join(map(str, ids)), flush=True)
""")


def _paced(**pace) -> ConnectionBounds:
    return replace(ConnectionBounds(), pace=PaceLimits(**pace))


async def _generate(path) -> tuple:
    async with await AsyncClient.connect(path) as client:
        result = await client.generate(prompt="honest", max_tokens=6, logits=True, cache=False).collect()
    return result.ids, result.logits_sha256, result.finish_reason


async def _run_flood(path, frames: int, sent: anyio.Event, out: dict) -> None:
    """The flood in its own process; sets `sent` once its frames are written, then fills
    `out` with its pid and the reply ids it read, in order."""
    cmd = [sys.executable, "-c", _FLOOD, str(path), str(frames)]
    async with await anyio.open_process(cmd, env={**os.environ, "PYTHONPATH": ROOT}) as proc:
        text = ""
        async for chunk in proc.stdout:
            text += chunk.decode()
            if text.startswith("sent\n"):
                sent.set()
        await proc.wait()
    sent.set()
    lines = text.splitlines()
    out["pid"], out["ids"] = proc.pid, [int(i) for i in lines[1].split()] if len(lines) > 1 else []


async def test_a_flooding_client_is_paced_while_an_honest_one_beside_it_is_not(tmp_path):
    # a rate far below any daemon's detokenize rate, so the flood waits even on a loaded machine
    bounds = _paced(rate=100.0, burst=50, error_cost=16, connect_cost=0)
    async with running_server(tmp_path, bounds=bounds) as server:
        solo = await _generate(server.socket_path)
        flood: dict = {}
        async with anyio.create_task_group() as tg:
            sent = anyio.Event()
            tg.start_soon(_run_flood, server.socket_path, 600, sent, flood)
            await sent.wait()
            beside = await _generate(server.socket_path)  # while the flood is read at its pace
            paced = server.gate.pacer.clients[(flood.get("pid") or _only_other_peer(server), os.getuid())]
        assert flood["ids"] == list(range(600))  # every frame answered, in order: nothing dropped
        assert paced.counts.frames == 600 and paced.counts.waits > 0  # 550 frames past its burst waited
        assert beside == solo  # the honest stream: the same tokens and logits bits as alone
        status = await _status(server)
        assert status["paced_waits"] == paced.counts.waits  # every pause was the flood's
        await wait_idle(server)


def _only_other_peer(server) -> int:
    (pid,) = {pid for pid, _ in server.gate.pacer.clients if pid != os.getpid()}
    return pid


async def _status(server) -> dict:
    async with await AsyncClient.connect(server.socket_path) as client:
        return await client.status()


async def test_refused_frames_and_connections_cost_their_price_and_a_reconnect_keeps_the_debt(tmp_path):
    bounds = _paced(rate=1e-6, burst=1000, error_cost=16, connect_cost=5)  # next to no refill
    async with running_server(tmp_path, bounds=bounds) as server:
        for _ in range(2):  # the second connection finds the budget the first one left
            async with await FramedStream.connect(server.socket_path) as framed:
                await framed.stream.send(b"".join(encode_frame({"type": "nope", "id": i}) for i in range(10)))
                replies = [await framed.receive() for _ in range(10)]
                assert {r["code"] for r in replies} == {"unknown_type"}
                await framed.send({"type": "detokenize", "id": 99, "ids": [100]})
                assert (await framed.receive())["text"] == "a"
        budget = server.gate.pacer.clients[(os.getpid(), os.getuid())]
        assert (budget.counts.frames, budget.counts.errors) == (22, 20)
        assert round(budget.credits) == 1000 - 2 * 5 - 20 * 16 - 2  # two connects, 20 errors, 2 good frames


async def test_a_client_in_debt_is_answered_once_it_is_out_of_debt(tmp_path):
    bounds = _paced(rate=100.0, burst=4, error_cost=24, connect_cost=0)
    async with running_server(tmp_path, bounds=bounds) as server:
        async with await FramedStream.connect(server.socket_path) as framed:
            await framed.stream.send(encode_frame({"type": "nope", "id": 1}) +
                                     encode_frame({"type": "detokenize", "id": 2, "ids": [100]}))
            assert (await framed.receive())["code"] == "unknown_type"
            assert (await framed.receive())["text"] == "a"  # read after the 20-credit debt was paid
        counts = server.gate.pacer.clients[(os.getpid(), os.getuid())].counts
        assert counts.waits >= 1 and counts.frames == 2


async def test_600_frames_past_a_small_burst_are_all_answered_in_order(tmp_path):
    bounds = _paced(rate=300.0, burst=64, error_cost=16, connect_cost=0)  # below any daemon's frame rate
    async with running_server(tmp_path, bounds=replace(bounds, out_frames=16)) as server:
        data = b"".join(encode_frame({"type": "detokenize", "id": i, "ids": [100]}) for i in range(600))
        async with await FramedStream.connect(server.socket_path) as framed:
            await framed.stream.send(data)
            replies = [await framed.receive() for _ in range(600)]
        assert [r["id"] for r in replies] == list(range(600))
        assert server.gate.pacer.clients[(os.getpid(), os.getuid())].counts.waits > 0


async def test_rate_zero_turns_pacing_off(tmp_path):
    from prefixd.daemon.config import DaemonConfig

    cfg = DaemonConfig(client_frame_rate=0.0)
    assert ConnectionBounds.for_config(cfg).pace.rate is None
    async with running_server(tmp_path, bounds=_paced(rate=None)) as server:
        assert (await _generate(server.socket_path))[2] == "length"
        assert server.gate.pacer.clients == {}


async def test_a_client_in_debt_is_let_back_in_with_a_quantum_of_its_rate():
    # Let in frame by frame, a flood would cost the loop a timer, a wake-up and a write per
    # frame; once in debt, a client waits until QUANTUM_S of its rate has refilled.
    from prefixd.front.pacing import QUANTUM_S, ClientBudget

    budget = ClientBudget(PaceLimits(rate=1000.0, burst=4096), anyio.current_time())
    budget.charge(budget.credits + 1, anyio.current_time())  # one credit in debt
    await budget.wait()
    assert budget.counts.waits == 1
    assert abs(budget.counts.waited_s - (1000.0 * QUANTUM_S + 1) / 1000.0) < 1e-3
    assert budget.credits >= 1000.0 * QUANTUM_S - 1  # a batch of frames may be read now
    assert ClientBudget(PaceLimits(rate=10.0, burst=4), 0.0).quantum() == 1.0  # at least one frame
    assert ClientBudget(PaceLimits(rate=1e6, burst=64), 0.0).quantum() == 64.0  # at most the burst
