"""`--kv-events`: the engine process publishes its store's KV events over ZMQ (docs/scale.md).

    PUB    endpoint       [topic, seq (8 bytes big-endian), msgpack EventBatch] per round with changes
                          (each event an array, or with ?layout=map a tagged map)
    ROUTER replay         in: [start seq (8 bytes)]   out: [seq, batch] per batch from the ring
                          (or one snapshot batch), then [-1 (8 bytes, signed), b""]

No thread: the engine loop calls `after_round` between rounds and, while idle, waits on
`fileno()` too. Every send is NOBLOCK; a ZMQ error is logged and counted and the round goes
on. Sequence numbers start at the wall clock in microseconds, so a restarted engine's are
above its predecessor's and a router that asks for what it missed gets a snapshot.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, NamedTuple
from urllib.parse import parse_qs

import msgpack

from prefixd.scheduler.store.announce import (LAYOUTS, AllBlocksCleared, Announcer, BlockStored, KvEvent,
                                              batch_to_wire)

log = logging.getLogger("prefixd.kv_events")

RING_BATCHES = 10_000  # batches the replay socket can send again
SEND_HWM = 10_000  # messages ZMQ queues per subscriber before it drops
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class Endpoint(NamedTuple):
    address: str  # tcp://HOST:PORT or ipc://PATH
    topic: bytes  # the first frame of every message
    layout: str  # each event as vLLM's legacy "array" or its tagged "map" (announce.LAYOUTS)


def parse_endpoint(text: str) -> Endpoint:
    """`tcp://HOST:PORT` or `ipc://PATH`, with optional `?topic=NAME` and `layout=array|map`.
    Raises ValueError with what was expected."""
    endpoint, _, query = text.partition("?")
    if not (endpoint.startswith("tcp://") and ":" in endpoint[6:]) and not (
            endpoint.startswith("ipc://") and len(endpoint) > 6):
        raise ValueError("expected tcp://HOST:PORT or ipc://PATH")
    params = parse_qs(query, keep_blank_values=True)
    if set(params) - {"topic", "layout"}:
        raise ValueError("the only parameters are topic=NAME and layout=array|map")
    layout = params.get("layout", ["array"])[-1]
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout}: expected one of {', '.join(LAYOUTS)}")
    return Endpoint(endpoint, params.get("topic", [""])[-1].encode(), layout)


class KvEventPublisher:
    """The PUB socket, the replay ring and the replay ROUTER socket (None: no replay)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, *, medium: str,
                 ring_batches: int = RING_BATCHES, clock: Callable[[], float] = time.time) -> None:
        import zmq

        self._zmq = zmq
        self.endpoint, self.topic, self.layout = parse_endpoint(endpoint)
        self.medium = medium
        self._clock = clock
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
            self._pub.bind(self.endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(parse_endpoint(replay_endpoint).address)
        except zmq.ZMQError:
            self.close()
            raise
        self.next_seq = time.time_ns() // 1000
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring_batches)
        self.num_batches = self.num_errors = self.num_replays = self.num_snapshots = 0

    def fileno(self) -> int | None:
        """The replay socket's ZMQ descriptor (edge-triggered: drain with `serve_replay`)."""
        return None if self._replay is None else self._replay.getsockopt(self._zmq.FD)

    def publish(self, events: list[KvEvent]) -> None:
        """One batch of `events` (nothing when there are none), into the ring and out."""
        if not events:
            return
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        payload = msgpack.packb(batch_to_wire(self._clock(), events, self.medium, layout=self.layout))
        self._ring.append((seq, payload))
        self.num_batches += 1
        self._send(self._pub, [self.topic, seq.to_bytes(8, "big"), payload])

    def serve_replay(self, snapshot: Callable[[], list[BlockStored]]) -> None:
        """Answer every replay request waiting. A start seq the ring still holds gets the
        batches from it on; an older one gets one batch: AllBlocksCleared, then `snapshot()`,
        numbered as the latest batch (it says the state that batch left)."""
        zmq = self._zmq
        while self._replay is not None:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                self._failed("replay receive", e)
                return
            head, body = frames[:1], frames[1:]
            if body and body[0] == b"":  # a REQ client's envelope
                head, body = frames[:2], frames[2:]
            if len(body) != 1 or len(body[0]) != 8:
                log.warning("KV events replay: a request of %d frames, not one 8-byte seq: ignored", len(body))
                self._send(self._replay, head + [END_OF_REPLAY, b""])
                continue
            self.num_replays += 1
            for seq, payload in self._replayed(int.from_bytes(body[0], "big", signed=True), snapshot):
                self._send(self._replay, head + [seq.to_bytes(8, "big"), payload])
            self._send(self._replay, head + [END_OF_REPLAY, b""])

    def _replayed(self, start: int, snapshot: Callable[[], list[BlockStored]]) -> list[tuple[int, bytes]]:
        if not self._ring or start > self._ring[-1][0]:
            return []
        if start >= self._ring[0][0]:
            return [item for item in self._ring if item[0] >= start]
        self.num_snapshots += 1
        events: list[KvEvent] = [AllBlocksCleared(), *snapshot()]
        batch = batch_to_wire(self._clock(), events, self.medium, layout=self.layout)
        return [(self._ring[-1][0], msgpack.packb(batch))]

    def _send(self, sock: Any, frames: list[bytes]) -> None:
        try:
            sock.send_multipart(frames, self._zmq.NOBLOCK)
        except self._zmq.ZMQError as e:
            self._failed("send", e)

    def _failed(self, what: str, error: Exception) -> None:
        self.num_errors += 1
        if self.num_errors == 1 or self.num_errors % 1000 == 0:
            log.warning("KV events: %s failed (%s); %d errors so far, serving goes on", what, error, self.num_errors)

    def status(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "next_seq": self.next_seq, "batches": self.num_batches,
                "errors": self.num_errors, "replays": self.num_replays, "snapshots": self.num_snapshots,
                "ring": len(self._ring)}

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
        self._ctx.term()


class KvEvents:
    """The store's announcer and its publisher, as the engine loop drives them."""

    def __init__(self, store: Any, publisher: KvEventPublisher) -> None:
        self.store = store
        self.publisher = publisher
        self.announcer = Announcer(store.page_size, snapshots=not store.invariant_rows)
        store.announce_to(self.announcer)
        publisher.publish([AllBlocksCleared()])  # whatever an engine before this one held is gone

    def fileno(self) -> int | None:
        return self.publisher.fileno()

    def after_round(self) -> None:
        """Publish what the store changed since the last call, then answer replays."""
        self.publisher.publish(self.announcer.take())
        self.serve_replay()

    def serve_replay(self) -> None:
        self.publisher.serve_replay(lambda: self.store.kv_blocks(snapshots=self.announcer.snapshots))

    def status(self) -> dict[str, Any]:
        return {**self.publisher.status(), "blocks": self.announcer.num_held}

    def close(self) -> None:
        self.publisher.close()


def open_kv_events(config: Any, engine: Any) -> KvEvents | None:
    """The KV events of `engine`'s store as `config` asks (None: off, or no store). Raises
    StartupError when pyzmq is missing or an endpoint cannot be bound."""
    from prefixd.daemon.startup import StartupError

    if not getattr(config, "kv_events", "") or engine.store is None:
        return None
    try:
        import zmq
    except ImportError:
        raise StartupError("--kv-events needs pyzmq: pip install 'prefixd[kv-events]'") from None
    medium = "CPU" if str(config.device) == "cpu" else "GPU"
    try:
        publisher = KvEventPublisher(config.kv_events, config.kv_events_replay or None, medium=medium)
    except (zmq.ZMQError, ValueError) as e:
        raise StartupError(f"--kv-events: cannot bind {config.kv_events} "
                           f"(replay {config.kv_events_replay or 'off'}): {e}") from None
    log.info("KV events on %s (replay %s)", publisher.endpoint, config.kv_events_replay or "off")
    return KvEvents(engine.store, publisher)
