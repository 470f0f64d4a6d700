"""Token delivery from the engine process (`--stream-interval`): a stream's later tokens wait
in the engine's outbox to travel with the next rounds' as one event, while its first token,
its end and every reply go at once and in order. The outbox alone with explicit times, then
the engine loop over a socketpair on the letter device."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from prefixd.engine.contract import decode, encode, message
from prefixd.engine.link import BlockingLink, LinkReader, pack
from prefixd.engine.process import EngineLoop, RecordingObserver, RoundOutbox
from prefixd.ipc.framing import close_fds
from prefixd.scheduler.records import TokenLogprob
from prefixd.ipc.events import Usage
from prefixd.scheduler.streams import DoneEvent, StreamRequest, TokenEvent
from tests.daemon.fakes import LetterDevice, fake_runtime_factory

ROUND_S = 0.005


def done(sid: int) -> DoneEvent:
    return DoneEvent(sid, "length", Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=0))


# -- the outbox ------------------------------------------------------------------------------


def test_first_token_goes_at_once_and_later_ones_wait_until_one_more_round_would_pass_the_interval():
    box = RoundOutbox(0.02)
    box.add([TokenEvent(1, (10,))], [], now=0.0)
    assert box.due(0.0, ROUND_S)  # the request's time to first token
    assert box.take() == ([TokenEvent(1, (10,))], [])
    for i, t in enumerate((0.005, 0.010, 0.015)):
        box.add([TokenEvent(1, (11 + i,))], [("round", (i,))], now=t)
        assert box.due(t, ROUND_S) == (t - 0.005 + ROUND_S >= 0.02), t
    assert box.due(0.020, ROUND_S)  # the oldest has waited 15 ms: one more round reaches 20
    assert box.take() == ([TokenEvent(1, (11, 12, 13))], [("round", (0,)), ("round", (1,)), ("round", (2,))])
    assert not box and not box.due(1.0, ROUND_S)


def test_an_end_goes_at_once_after_the_streams_waiting_tokens_and_streams_keep_their_order():
    box = RoundOutbox(10.0)
    box.add([TokenEvent(1, (1,)), TokenEvent(2, (5,))], [], now=0.0)
    box.take()
    box.add([TokenEvent(1, (2,)), TokenEvent(2, (6,))], [], now=0.01)
    assert not box.due(0.01, ROUND_S)
    box.add([TokenEvent(2, (7,)), TokenEvent(1, (3,)), done(1)], [], now=0.02)
    assert box.due(0.02, ROUND_S)
    assert box.take()[0] == [TokenEvent(1, (2, 3)), TokenEvent(2, (6, 7)), done(1)]


def test_digests_and_logprobs_are_joined_with_their_ids():
    box = RoundOutbox(10.0)
    lp = [TokenLogprob(-0.5, ((4, -0.5),)), TokenLogprob(-0.25, ((5, -0.25),))]
    box.add([TokenEvent(1, (3,), ("a",), (lp[0],))], [], now=0.0)
    box.take()
    box.add([TokenEvent(1, (4,), ("b",), (lp[0],))], [], now=0.01)
    box.add([TokenEvent(1, (5,), ("c",), (lp[1],))], [], now=0.02)
    assert box.take()[0] == [TokenEvent(1, (4, 5), ("b", "c"), (lp[0], lp[1]))]


def test_a_stream_id_seen_again_after_its_end_starts_afresh():
    box = RoundOutbox(10.0)
    box.add([TokenEvent(1, (1,))], [], now=0.0)
    box.add([done(1)], [], now=0.0)
    box.take()
    box.add([TokenEvent(1, (9,))], [], now=1.0)
    assert box.due(1.0, ROUND_S)


def test_interval_zero_sends_every_round():
    box = RoundOutbox(0.0)
    box.add([TokenEvent(1, (1,))], [], now=0.0)
    box.take()
    box.add([TokenEvent(1, (2,))], [], now=0.001)
    assert box.due(0.001, 0.0)
    box.take()
    box.add([], [("round", ())], now=0.002)  # observer calls alone go too
    assert box.due(0.002, 0.0)


# -- the engine loop -------------------------------------------------------------------------


class Front:
    """Our end of the link: sends commands, keeps every message in arrival order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = LinkReader()
        self.msgs: list[dict[str, Any]] = []

    def until(self, done: Any) -> None:
        while not done(self.msgs):
            self.msgs.extend(self.reader.feed(self.sock.recv(1 << 20), []))

    def events(self, upto: int | None = None) -> list[Any]:
        return [decode(e) for m in self.msgs[:upto] if m["t"] == "round" for e in m["events"]]


def ended(sid: int):
    return lambda msgs: any(m["t"] == "round" and any(isinstance(decode(e), DoneEvent) and decode(e).stream_id == sid
                                                      for e in m["events"]) for m in msgs)


def serve(interval_s: float, round_delay_s: float = 0.0):
    device = LetterDevice(max_context=256, round_delay_s=round_delay_s)
    observer = RecordingObserver()
    runtime = fake_runtime_factory(device)(None, observer)
    ours, theirs = socket.socketpair()
    ours.settimeout(60)
    loop = EngineLoop(BlockingLink(theirs), runtime, observer, idle_trim_s=None, stream_interval_s=interval_s)
    thread = threading.Thread(target=loop.run)
    thread.start()
    return device, Front(ours), thread


def stop(front: Front, thread: threading.Thread) -> None:
    front.sock.sendall(pack({"t": "stop"})[0])
    thread.join(60)
    front.reader.close()
    front.sock.close()
    assert not thread.is_alive()


def submit(sid: int, max_tokens: int) -> bytes:
    request = StreamRequest(stream_id=sid, tokens=(7, 8, 9), max_tokens=max_tokens, client="c")
    return pack(message("submit", request=encode(request)))[0]


def token_messages(front: Front, sid: int) -> list[tuple[int, ...]]:
    """Each round message's ids of stream `sid`, in order (messages without its tokens left out)."""
    out = []
    for m in front.msgs:
        if m["t"] != "round":
            continue
        ids = [i for e in map(decode, m["events"]) if isinstance(e, TokenEvent) and e.stream_id == sid for i in e.ids]
        if ids:
            out.append(tuple(ids))
    return out


@pytest.mark.parametrize("interval_s", [0.0, 3600.0])
def test_a_stream_gets_the_same_ids_in_one_message_a_round_or_its_first_alone_and_the_rest_with_its_end(interval_s):
    _, front, thread = serve(interval_s)
    try:
        front.sock.sendall(submit(1, 6))
        front.until(ended(1))
    finally:
        stop(front, thread)
    messages = token_messages(front, 1)
    ids = tuple(i for m in messages for i in m)
    assert len(ids) == 6
    if interval_s:
        assert messages == [ids[:1], ids[1:]]  # the end took the five that waited
    else:
        assert messages == [(i,) for i in ids]
    last = [m for m in front.msgs if m["t"] == "round"][-1]
    assert isinstance(decode(last["events"][-1]), DoneEvent)


def test_a_reply_goes_after_the_tokens_that_waited_for_it():
    device, front, thread = serve(3600.0, round_delay_s=0.01)
    try:
        front.sock.sendall(submit(1, 200))
        front.until(lambda msgs: any(m["t"] == "round" and m["events"] for m in msgs))
        rounds = device.rounds
        while device.rounds < rounds + 3:  # tokens now wait in the outbox (the interval is an hour)
            time.sleep(0.005)
        front.sock.sendall(pack({"t": "status", "q": 7})[0])
        front.until(lambda msgs: any(m["t"] == "status" for m in msgs))
        at = next(i for i, m in enumerate(front.msgs) if m["t"] == "status")
        seen = [i for e in front.events(at) if isinstance(e, TokenEvent) for i in e.ids]
        assert not ended(1)(front.msgs[:at]) and len(seen) >= 4  # the first, then at least three that waited
        front.sock.sendall(pack(message("cancel", id=1))[0])
        front.until(ended(1))
    finally:
        stop(front, thread)


# -- the round message's parts -----------------------------------------------------------------


def test_the_recording_observer_keeps_recording_after_each_take():
    observer = RecordingObserver()
    observer.on_token_gap(0.5)
    observer.on_round(0.01, 2, 2, 0)
    assert observer.take() == [["on_token_gap", [0.5]], ["on_round", [0.01, 2, 2, 0]]]
    observer.on_token_gap(0.25)  # the recorder it kept after the first call appends to the new list
    assert observer.take() == [["on_token_gap", [0.25]]]
    assert observer.take() == []
    with pytest.raises(AttributeError):
        observer.on_something_else  # noqa: B018 - only the contract's observer calls cross


def test_a_round_message_sent_inline_arrives_whole_even_where_pack_would_move_a_field_to_a_memfd():
    ours, theirs = socket.socketpair()
    ours.settimeout(60)
    reader = LinkReader()
    try:
        # an int list over the memfd threshold (pack would move it), in a frame of ~20 KB: the
        # socket's buffer takes it whole, so this one thread can send before it reads
        ids = tuple(i % 100 for i in range(20_000))
        moved = pack(message("round", events=[encode(TokenEvent(1, ids))]))[1]
        close_fds(moved)
        assert moved
        BlockingLink(theirs).send(message("round", events=[encode(TokenEvent(1, ids)), encode(done(1))],
                                          observed=[["on_token_gap", [0.5]]], pages=[3, 4]), inline=True)
        got: list[dict[str, Any]] = []
        while not got:
            got = reader.feed(ours.recv(1 << 20), [])
        (msg,) = got
        assert [decode(e) for e in msg["events"]] == [TokenEvent(1, ids), done(1)]
        assert msg["observed"] == [["on_token_gap", [0.5]]] and msg["pages"] == [3, 4]
    finally:
        reader.close()
        ours.close()
        theirs.close()
