"""The engine loop's pause before long work: once a short request has ended and only long
prefills are left, the loop waits (up to `pause_s`) for the client's next request before it
starts a round of long prefills alone, and that request's first token then goes out in a
round without them. Run in a thread over a socketpair, on the letter device."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from prefixd.engine.contract import decode, encode, message
from prefixd.engine.link import BlockingLink, LinkReader, pack
from prefixd.engine.process import EngineLoop, RecordingObserver
from prefixd.scheduler.streams import DoneEvent, StreamRequest, TokenEvent
from tests.daemon.fakes import LetterDevice, fake_runtime_factory

LONG = 200  # rows: more than short_prefill_rows (64), within the letter device's context


class Recorder(LetterDevice):
    """The letter device, keeping each round's plan."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.plans: list[Any] = []

    def run_round(self, plan: Any) -> Any:
        self.plans.append(plan)
        return super().run_round(plan)


def submit(sid: int, tokens: list[int], max_tokens: int, client: str) -> bytes:
    request = StreamRequest(stream_id=sid, tokens=tuple(tokens), max_tokens=max_tokens, client=client)
    return pack(message("submit", request=encode(request)))[0]


class Front:
    """Our end of the link: sends commands, reads round events."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = LinkReader()
        self.events: list[Any] = []

    def until(self, done: Any) -> None:
        """Read messages until `done(events)` holds."""
        while not done(self.events):
            for msg in self.reader.feed(self.sock.recv(1 << 20), []):
                if msg["t"] == "round":
                    self.events.extend(decode(e) for e in msg["events"])


def ended(sid: int):
    return lambda events: any(isinstance(e, DoneEvent) and e.stream_id == sid for e in events)


def test_after_a_short_request_the_loop_waits_for_the_next_before_long_prefills_run_alone():
    device = Recorder(max_context=256)
    observer = RecordingObserver()
    runtime = fake_runtime_factory(device)(None, observer)
    ours, theirs = socket.socketpair()
    ours.settimeout(60)
    loop = EngineLoop(BlockingLink(theirs), runtime, observer, idle_trim_s=None, pause_s=60.0)
    thread = threading.Thread(target=loop.run)
    thread.start()
    front = Front(ours)
    try:
        # Applied together: the short one's first token holds the long prefill back, its
        # second shares a busy round with it, then only the long prefill is left.
        ours.sendall(submit(1, [i % 50 + 1 for i in range(LONG)], 1, "flood") + submit(2, [7, 8, 9], 2, "honest"))
        front.until(ended(2))
        rounds = len(device.plans)
        time.sleep(0.5)  # without the pause the long prefill's remaining rounds run meanwhile
        assert len(device.plans) == rounds and not ended(1)(front.events)
        ours.sendall(submit(3, [4, 5, 6], 2, "honest"))
        front.until(lambda events: any(isinstance(e, TokenEvent) and e.stream_id == 3 for e in events))
        first = device.plans[rounds]
        assert [len(w.tokens) for w in first.lanes] == [3]  # its own prefill alone
        front.until(ended(3))
        ours.sendall(pack({"t": "status", "q": 1, "check": True})[0])  # any command ends the pause
        front.until(ended(1))
    finally:
        ours.sendall(pack({"t": "stop"})[0])
        thread.join(60)
        front.reader.close()
        ours.close()
    assert not thread.is_alive()
