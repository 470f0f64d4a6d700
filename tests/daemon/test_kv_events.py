"""--kv-events through real ZMQ sockets: a router's view of each daemon's pages, a late router
that replays, and an engine that restarts."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Iterator

import anyio
import msgpack
import pytest

zmq = pytest.importorskip("zmq")

from prefixd.ipc.client import AsyncClient  # noqa: E402
from prefixd.scheduler.store.announce import PAGES, View, held, prompt_hashes  # noqa: E402
from tests.daemon.fakes import ByteTokenizer, LetterDevice  # noqa: E402
from tests.daemon.harness import idle_engine, running_server, wait_idle  # noqa: E402
from tests.daemon.test_engine_process import letters_config, letters_engine, process_server, wait_serving  # noqa: E402

END = -1


@pytest.fixture
def sockets() -> Iterator[Path]:
    """A short directory for ipc:// paths (a Unix socket path has ~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Router:
    """A router's end: SUB on the events, DEALER on the replay socket; keeps a `View`."""

    def __init__(self, pub: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.view = View()
        self.last: int | None = None
        self.num_gaps = self.num_replayed = 0

    def ask(self, start: int) -> list[tuple[int, list]]:
        """Replay from `start`: the (seq, batch) pairs the daemon sends, up to its end marker."""
        self.replay.send(start.to_bytes(8, "big", signed=True))
        out = []
        while True:
            assert self.replay.poll(10_000), "no replay answer"
            seq_bytes, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END:
                assert payload == b""
                return out
            out.append((seq, msgpack.unpackb(payload)))

    def sync(self, start: int = 0) -> None:
        """Apply what a replay from `start` sends (from 0: a snapshot of the store)."""
        for seq, batch in self.ask(start):
            self.view.apply_wire(batch)
            self.last = seq
            self.num_replayed += 1

    def pump(self) -> int:
        """Apply every message waiting; a gap in the numbers is filled by a replay first."""
        n = 0
        while self.sub.poll(0):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.last is not None and seq <= self.last:
                continue  # the replay already had it
            if self.last is not None and seq != self.last + 1:
                self.num_gaps += 1
                self.sync(self.last + 1)
                if seq <= self.last:  # type: ignore[operator]
                    continue
            self.view.apply_wire(msgpack.unpackb(payload))
            self.last = seq
            n += 1
        return n

    async def until(self, expected: set) -> None:
        """Pump until the view is `expected`; while nothing comes, ask for what follows the
        last batch seen (a SUB that (re)connects misses what was sent before)."""
        quiet = 0
        with anyio.fail_after(20):
            while True:
                quiet = 0 if self.pump() else quiet + 1
                if self.view.blocks == expected:
                    return
                if quiet >= 25 and self.last is not None:
                    self.sync(self.last + 1)
                    quiet = 0
                await anyio.sleep(0.02)

    def close(self) -> None:
        self.ctx.destroy(0)


def page_set(*texts: str, page_size: int = 4) -> set[tuple[int, int]]:
    tok = ByteTokenizer()
    return {(PAGES, h) for t in texts for h in prompt_hashes(tok.encode(t), page_size)}


async def turn(server, prompt: str) -> None:
    async with await AsyncClient.connect(server.socket_path) as client:
        await client.generate(prompt=prompt, max_tokens=2).collect()


async def test_a_router_sees_the_pages_the_store_holds_through_evictions_and_a_late_start(sockets):
    pub, replay = f"ipc://{sockets}/kv.sock", f"ipc://{sockets}/replay.sock"
    device = LetterDevice(num_lanes=1, num_pages=12, max_context=48)
    async with running_server(sockets, device, kv_events=pub, kv_events_replay=replay) as server:
        early = Router(pub, replay)
        try:
            early.sync()  # a router that starts with the daemon: a snapshot, then the live events
            first, second = "the first conversation, long", "another one entirely, as long"
            await turn(server, first)
            await wait_idle(server)
            store = idle_engine(server).store
            await early.until(held(store.kv_blocks(snapshots=False)))
            assert page_set(first) <= early.view.blocks
            await turn(server, second)  # 12 pages: the first conversation's are evicted for it
            await wait_idle(server)
            own = held(store.kv_blocks(snapshots=False))
            await early.until(own)
            assert page_set(second) <= own and not page_set(first) <= own
            assert sum(store.stats().evictions.values()) > 0
            late = Router(pub, replay)  # a router that starts now has missed every event
            try:
                late.sync()
                assert late.view.blocks == own and late.num_replayed == 1
                status = await server.link.status()
                assert status["kv_events"]["snapshots"] >= 2 and status["kv_events"]["errors"] == 0
                assert status["kv_events"]["blocks"] == len(own)
            finally:
                late.close()
        finally:
            early.close()


async def test_after_an_engine_restart_a_router_catches_up_by_replay(sockets, tmp_path):
    pub, replay = f"ipc://{sockets}/kv.sock", f"ipc://{sockets}/replay.sock"
    cfg = letters_config(tmp_path, kv_events=pub, kv_events_replay=replay)
    async with process_server(tmp_path, letters_engine(cfg), cfg) as server:
        await wait_serving(server)
        router = Router(pub, replay)
        try:
            router.sync()
            await turn(server, "a conversation before the crash")
            await router.until(page_set("a conversation before the crash"))
            before = router.last
            os.kill(server.link.pid, signal.SIGKILL)
            await turn(server, "and one after it, on a new engine")  # waits for the restarted engine
            # the new engine's numbers start past the old one's: the gap asks for a replay, which
            # is older than the new ring and comes back as a snapshot of the new store
            await router.until(page_set("and one after it, on a new engine"))
            assert router.last is not None and before is not None and router.last > before
            status = await server.link.status()
            assert status["kv_events"]["snapshots"] >= 1  # the new engine's
            again = Router(pub, replay)
            try:
                again.sync()
                assert again.view.blocks == router.view.blocks
            finally:
                again.close()
        finally:
            router.close()
