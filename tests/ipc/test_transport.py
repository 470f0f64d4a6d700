"""FramedStream.send_many: a burst of replies goes out in one write, in order; a map with
descriptors is written on its own; a map that does not fit stops the burst after the maps
before it. FramedStream.receive_frame with `off_loop_bytes`: a read that completes that many
bytes of frames is decoded on a worker thread, with the same maps and the same errors."""

from __future__ import annotations

import socket

import anyio
import msgpack
import pytest
from anyio.abc import UNIXSocketStream

from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.framing import FrameDecoder, Limits, encode_frame
from prefixd.ipc.transport import FramedStream


class RecordingStream:
    """Stands in for the socket stream: records each write."""

    def __init__(self) -> None:
        self.writes: list[tuple[bytes, int]] = []  # data, number of descriptors

    async def send(self, data: bytes) -> None:
        self.writes.append((bytes(data), 0))

    async def send_fds(self, data: bytes, fds: list[int]) -> None:
        self.writes.append((bytes(data), len(fds)))

    def extra(self, attribute: object, default: object = None) -> object:
        return default  # no raw socket: every write goes through send()


async def test_maps_without_descriptors_go_out_in_one_write_in_order():
    stream = RecordingStream()
    framed = FramedStream(stream)  # type: ignore[arg-type]
    msgs = [{"type": "text", "id": i, "text": "x" * i} for i in range(50)]
    await framed.send_many(msgs)
    assert [n for _, n in stream.writes] == [0]
    assert stream.writes[0][0] == b"".join(encode_frame(m, framed.limits) for m in msgs)
    assert [f.msg for f in FrameDecoder(framed.limits).feed_fds(stream.writes[0][0], [])] == msgs


async def test_a_map_with_a_payload_is_written_on_its_own_between_the_others():
    stream = RecordingStream()
    framed = FramedStream(stream, Limits(memfd_threshold_bytes=1024))  # type: ignore[arg-type]
    big = {"type": "rows", "id": 2, "rows": bytes(8192)}
    await framed.send_many([{"type": "ok", "id": 1}, big, {"type": "ok", "id": 3}])
    assert [n for _, n in stream.writes] == [0, 1, 0]


async def test_a_map_that_does_not_fit_is_not_sent_but_the_ones_before_it_are():
    stream = RecordingStream()
    framed = FramedStream(stream, Limits(max_frame_bytes=4096), memfd_payloads=False)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        await framed.send_many([{"type": "ok", "id": 1}, {"type": "text", "id": 2, "text": "x" * 8192},
                                {"type": "ok", "id": 3}])
    assert stream.writes == [(encode_frame({"type": "ok", "id": 1}, framed.limits), 0)]


class CountingSocketStream:
    """A socketpair end as FramedStream sees it, counting the writes that go through the
    stream's awaited send (the event loop) rather than straight to the socket."""

    def __init__(self, stream: UNIXSocketStream) -> None:
        self.stream = stream
        self.awaited = 0

    async def send(self, data: bytes) -> None:
        self.awaited += 1
        await self.stream.send(data)

    async def send_fds(self, data: bytes, fds: list[int]) -> None:
        self.awaited += 1
        await self.stream.send_fds(data, fds)

    def extra(self, attribute: object, default: object = None) -> object:
        return self.stream.extra(attribute, default)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


async def test_a_write_the_socket_takes_at_once_skips_the_event_loop():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    counting = CountingSocketStream(await UNIXSocketStream.from_socket(ours))
    framed = FramedStream(counting)  # type: ignore[arg-type]
    msgs = [{"type": "token", "id": i, "ids": [i]} for i in range(20)]
    for msg in msgs:
        await framed.send(msg)
    assert counting.awaited == 0
    await counting.stream.aclose()
    received = [f.msg for f in FrameDecoder(framed.limits).feed_fds(_read_all(theirs), [])]
    theirs.close()
    assert received == msgs


async def _drain(theirs: socket.socket, into: list[bytes]) -> None:
    into.append(await anyio.to_thread.run_sync(_read_all, theirs))


def _small_buffer_pair() -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return ours, theirs


BIG = {"type": "text", "id": 1, "text": "x" * 100_000}  # many times a small socket buffer


async def test_a_write_the_socket_takes_in_part_ends_through_the_loop_in_order():
    """A frame larger than the socket's buffer: its first bytes go out at once, the rest
    through the awaited send while the peer reads; the peer gets every frame whole, in order."""
    ours, theirs = _small_buffer_pair()
    counting = CountingSocketStream(await UNIXSocketStream.from_socket(ours))
    framed = FramedStream(counting, memfd_payloads=False)  # type: ignore[arg-type]
    got: list[bytes] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_drain, theirs, got)
        try:
            await framed.send(BIG)
            await framed.send({"type": "ok", "id": 2})
        finally:
            await counting.stream.aclose()  # the reader's end of stream
    theirs.close()
    assert counting.awaited == 1  # the big frame's rest; the small one went at once
    assert [f.msg for f in FrameDecoder(framed.limits).feed_fds(got[0], [])] == [BIG, {"type": "ok", "id": 2}]


async def test_a_send_cancelled_waiting_for_its_turn_leaves_the_stream_whole():
    """Nothing of a send cancelled while another is in flight is on the wire: the stream stays
    usable (only a send cut part-way breaks it)."""
    ours, theirs = _small_buffer_pair()
    framed = FramedStream(await UNIXSocketStream.from_socket(ours), memfd_payloads=False)
    sent_big = anyio.Event()
    got: list[bytes] = []

    async def send_big() -> None:
        await framed.send(BIG)
        sent_big.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(send_big)
        await anyio.wait_all_tasks_blocked()  # the big frame fills the buffer and waits
        with anyio.move_on_after(0.05):
            await framed.send({"type": "ok", "id": 2})  # waits for the big one's turn: cancelled
        tg.start_soon(_drain, theirs, got)
        try:
            await sent_big.wait()
            await framed.send({"type": "ok", "id": 3})
        finally:
            await framed.stream.aclose()  # the reader's end of stream
    theirs.close()
    assert [f.msg for f in FrameDecoder(framed.limits).feed_fds(got[0], [])] == [BIG, {"type": "ok", "id": 3}]


class ThreadHops:
    """Counts the calls FramedStream makes through anyio.to_thread.run_sync (and makes them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = anyio.to_thread.run_sync

        async def counting(fn, *args, **kwargs):
            self.calls += 1
            return await real(fn, *args, **kwargs)

        monkeypatch.setattr(anyio.to_thread, "run_sync", counting)


def chat(n: int) -> dict:
    return {"type": "tokenize", "id": 7, "messages": [{"role": "user", "content": f"m{i}"} for i in range(n)]}


async def _received(msgs: list[bytes], off_loop_bytes: int | None) -> tuple[list, list[ProtocolError]]:
    """What a FramedStream reading a socketpair makes of `msgs` (raw bytes, each sent whole,
    then the other end closes): the maps, and the error that ended the reading, if any."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    framed = FramedStream(await UNIXSocketStream.from_socket(ours), off_loop_bytes=off_loop_bytes)
    maps: list = []
    errors: list[ProtocolError] = []

    def send() -> None:
        for data in msgs:
            theirs.sendall(data)
        theirs.close()

    async with framed:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, send)
            try:
                while True:
                    maps.append((await framed.receive_frame()).msg)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            except ProtocolError as e:
                errors.append(e)
    return maps, errors


async def test_a_read_completing_a_big_frame_is_decoded_off_the_loop_with_the_same_map(monkeypatch):
    big = chat(8000)  # ~200 KB: several reads, only the last completes it
    small = {"type": "status", "id": 1}
    frames = [encode_frame(small), encode_frame(big), encode_frame(small)]
    assert 2 * (64 << 10) < len(frames[1]) < Limits().max_frame_bytes
    hops = ThreadHops(monkeypatch)
    maps, errors = await _received(frames, off_loop_bytes=64 << 10)
    off_loop_calls = hops.calls - 1  # one hop is the sender's own thread
    assert errors == [] and maps == [small, big, small]
    assert off_loop_calls >= 1  # the read that ended the big frame
    assert off_loop_calls <= 2  # not the reads that only added to it, nor the small frames'

    hops.calls = 0
    maps, errors = await _received(frames, off_loop_bytes=None)
    assert errors == [] and maps == [small, big, small] and hops.calls == 1  # the sender's only


async def test_small_frames_stay_on_the_loop(monkeypatch):
    frames = [encode_frame({"type": "detokenize", "id": i, "ids": [65, 66]}) for i in range(50)]
    hops = ThreadHops(monkeypatch)
    maps, errors = await _received([b"".join(frames)], off_loop_bytes=64 << 10)
    assert errors == [] and [m["id"] for m in maps] == list(range(50)) and hops.calls == 1


@pytest.mark.parametrize("off_loop_bytes", [None, 1024])
async def test_a_bad_big_frame_off_the_loop_is_the_same_framing_error(off_loop_bytes):
    deep: object = 1
    for _ in range(12):
        deep = [deep]
    body = msgpack.packb({"type": "tokenize", "id": 3, "pad": "x" * 4096, "deep": deep})
    bad_key = msgpack.packb({"type": "tokenize", "id": 3, "pad": "x" * 4096, "m": {1: 2}}, strict_types=False)
    for raw, words in ((body, "nesting deeper"), (bad_key, "map key")):
        maps, errors = await _received([len(raw).to_bytes(4, "big") + raw], off_loop_bytes)
        assert maps == [] and len(errors) == 1
        assert errors[0].code == ErrorCode.BAD_FRAME and words in str(errors[0]), (off_loop_bytes, str(errors[0]))
