"""memfd payloads over a real socketpair: automatic offload, checks on forged segments,
and no descriptor leaks on any path."""

from __future__ import annotations

import array
import fcntl
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from anyio.abc import UNIXSocketStream

from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.framing import Dtype, Limits, MemfdRef, encode_frame
from prefixd.ipc.memfd import create_segment, extract_payloads
from prefixd.ipc.transport import FramedStream


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
async def pair() -> AsyncIterator[tuple[FramedStream, socket.socket]]:
    """A FramedStream reading one end; the raw other end for forging sends."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    framed = FramedStream(await UNIXSocketStream.from_socket(ours))
    yield framed, theirs
    theirs.close()
    await framed.aclose()


@pytest.fixture
async def framed_pair() -> AsyncIterator[tuple[FramedStream, FramedStream]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left = FramedStream(await UNIXSocketStream.from_socket(a))
    right = FramedStream(await UNIXSocketStream.from_socket(b))
    yield left, right
    await left.aclose()
    await right.aclose()


def send_with_fds(sock: socket.socket, msg: dict[str, Any], fds: list[int]) -> None:
    data = encode_frame(msg)
    ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    assert sock.sendmsg([data], ancdata) == len(data)


def memfd_of(data: bytes, seals: int | None = None) -> int:
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals is not None:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def test_extract_moves_only_fields_over_the_threshold() -> None:
    limits = Limits(memfd_threshold_bytes=16)
    rows = memoryview(array.array("f", [1.5] * 8))
    msg = {"tokens": [1, 2, 3, 4], "long": list(range(5)), "rows": rows, "small": b"abc", "nested": {"b": b"x" * 17}}
    out, fds = extract_payloads(msg, limits)
    try:
        assert out == {
            "tokens": [1, 2, 3, 4],
            "long": MemfdRef(0, 20, Dtype.INT32),
            "rows": MemfdRef(1, 32, Dtype.FLOAT32),
            "small": b"abc",
            "nested": {"b": MemfdRef(2, 17, Dtype.BYTES)},
        }
        assert out["tokens"] is msg["tokens"]  # untouched containers are shared
        assert msg["long"] == [0, 1, 2, 3, 4]  # the caller's map is not changed
        assert os.pread(fds[0], 20, 0) == array.array("i", range(5)).tobytes()
        assert fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & SEALED == SEALED
    finally:
        for fd in fds:
            os.close(fd)


def test_int_lists_outside_int32_stay_inline() -> None:
    limits = Limits(memfd_threshold_bytes=8)
    msg = {"a": [1 << 40, 1, 2], "b": [1.0, 2.0, 3.0], "c": ["x", "y", "z"]}
    assert extract_payloads(msg, limits) == (msg, [])


async def test_large_tokens_and_rows_travel_as_memfds_and_arrive_equal(
    framed_pair: tuple[FramedStream, FramedStream],
) -> None:
    left, right = framed_pair
    baseline = open_fds()
    tokens = [i % 49152 for i in range(40_000)]  # 160 KB as int32
    rows = array.array("f", [0.25 * i for i in range(30_000)])  # 120 KB
    image = {"at": 0, "tokens": 10, "gh": 2, "gw": 5, "hash": b"h" * 32, "rows": memoryview(rows)}
    msg = {"type": "generate", "id": 1, "tokens": tokens, "images": [image]}
    async with anyio.create_task_group() as tg:
        tg.start_soon(left.send, msg)
        got = await right.receive()
    assert got["tokens"] == tokens
    assert got["images"][0]["rows"] == rows.tobytes()
    assert open_fds() == baseline  # the sender's and receiver's copies are all closed


async def test_frames_with_and_without_fds_interleave_correctly(
    framed_pair: tuple[FramedStream, FramedStream],
) -> None:
    left, right = framed_pair
    baseline = open_fds()
    msgs = []
    for i in range(12):
        big = bytes([i]) * (70_000 + i) if i % 3 != 1 else b"s"
        msgs.append({"id": i, "blob": big, "more": bytes([i + 1]) * 66_000 if i % 4 == 0 else b""})

    async def send_all() -> None:
        for msg in msgs:
            await left.send(msg)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send_all)
        got = [await right.receive() for _ in msgs]
    assert got == msgs
    assert open_fds() == baseline


async def receive_error(framed: FramedStream) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        await framed.receive()
    return info.value


@pytest.mark.parametrize(
    ("content", "seals", "declared", "why"),
    [
        (b"x" * 100, SEALED, 99, "memfd holds 100 bytes, declared 99"),
        (b"x" * 100, None, 100, "memfd is not sealed against shrink, grow and write"),
        (b"x" * 100, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, 100, "memfd is not sealed against shrink, grow and write"),
    ],
)
async def test_forged_memfd_is_bad_payload_and_leaks_nothing(
    pair: tuple[FramedStream, socket.socket], content: bytes, seals: int | None, declared: int, why: str
) -> None:
    framed, theirs = pair
    baseline = open_fds()
    fd = memfd_of(content, seals)
    send_with_fds(theirs, {"type": "generate", "id": 9, "blob": MemfdRef(0, declared, Dtype.BYTES)}, [fd])
    os.close(fd)
    error = await receive_error(framed)
    assert (error.code, error.message, error.request_id, error.fatal) == (ErrorCode.BAD_PAYLOAD, why, 9, False)
    assert open_fds() == baseline
    send_with_fds(theirs, {"type": "status", "id": 10}, [])
    assert await framed.receive() == {"type": "status", "id": 10}  # the connection goes on


async def test_a_pipe_is_not_a_memfd(pair: tuple[FramedStream, socket.socket]) -> None:
    framed, theirs = pair
    baseline = open_fds()
    r, w = os.pipe()
    send_with_fds(theirs, {"id": 3, "blob": MemfdRef(0, 0, Dtype.BYTES)}, [r])
    os.close(r)
    os.close(w)
    error = await receive_error(framed)
    assert error.code is ErrorCode.BAD_PAYLOAD and error.message.startswith("descriptor is not a sealed memfd")
    assert open_fds() == baseline


async def test_refs_without_descriptors_and_unreferenced_descriptors(pair: tuple[FramedStream, socket.socket]) -> None:
    framed, theirs = pair
    baseline = open_fds()
    fd = memfd_of(b"abc", SEALED)
    send_with_fds(theirs, {"id": 4, "blob": MemfdRef(1, 3, Dtype.BYTES)}, [fd])
    os.close(fd)
    error = await receive_error(framed)
    assert (error.code, error.message) == (ErrorCode.BAD_PAYLOAD, "memfd ref to descriptor 1, frame has 1")
    fds = [memfd_of(b"abc", SEALED) for _ in range(3)]
    send_with_fds(theirs, {"id": 5}, fds)  # descriptors nobody references
    for fd in fds:
        os.close(fd)
    assert await framed.receive() == {"id": 5}
    assert open_fds() == baseline


async def test_more_descriptors_than_allowed_are_a_framing_error_and_all_closed(
    pair: tuple[FramedStream, socket.socket],
) -> None:
    framed, theirs = pair
    baseline = open_fds()
    fds = [memfd_of(b"abc", SEALED) for _ in range(20)]
    send_with_fds(theirs, {"id": 6}, fds)
    for fd in fds:
        os.close(fd)
    error = await receive_error(framed)
    assert (error.code, error.fatal, error.message) == (
        ErrorCode.BAD_FRAME, True, "20 descriptors for one frame exceed 8")
    assert open_fds() == baseline


async def test_descriptors_over_the_limit_across_two_sends_of_one_frame(
    pair: tuple[FramedStream, socket.socket],
) -> None:
    framed, theirs = pair
    baseline = open_fds()
    data = encode_frame({"id": 6})
    fds = [memfd_of(b"abc", SEALED) for _ in range(10)]
    theirs.sendmsg([data[:2]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds[:5]))])
    theirs.sendmsg([data[2:]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds[5:]))])
    for fd in fds:
        os.close(fd)
    error = await receive_error(framed)
    assert (error.code, error.fatal) == (ErrorCode.BAD_FRAME, True)
    assert open_fds() == baseline


async def test_int32_payload_with_odd_size_is_bad_payload(pair: tuple[FramedStream, socket.socket]) -> None:
    framed, theirs = pair
    fd = memfd_of(b"abcdefg", SEALED)
    send_with_fds(theirs, {"id": 7, "tokens": MemfdRef(0, 7, Dtype.INT32)}, [fd])
    os.close(fd)
    error = await receive_error(framed)
    assert error.message == "memfd of 7 bytes is not a whole number of INT32"


async def test_descriptors_of_a_frame_in_progress_are_closed_on_aclose() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    framed = FramedStream(await UNIXSocketStream.from_socket(ours))
    baseline = open_fds()
    data = encode_frame({"id": 1, "blob": MemfdRef(0, 3, Dtype.BYTES)})
    fd = memfd_of(b"abc", SEALED)
    theirs.sendmsg([data[:5]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    os.close(fd)
    with anyio.move_on_after(0.5):
        await framed.receive()  # reads the partial frame and its descriptor, then waits
    await framed.aclose()
    theirs.close()
    assert open_fds() == baseline - 2  # minus both sockets


async def test_truncated_frame_at_end_of_stream_is_bad_frame(pair: tuple[FramedStream, socket.socket]) -> None:
    framed, theirs = pair
    theirs.sendall(encode_frame({"id": 1})[:-1])
    theirs.shutdown(socket.SHUT_WR)
    error = await receive_error(framed)
    assert (error.code, error.fatal) == (ErrorCode.BAD_FRAME, True)


async def test_clean_end_of_stream_raises_end_of_stream(pair: tuple[FramedStream, socket.socket]) -> None:
    framed, theirs = pair
    theirs.sendall(encode_frame({"id": 1}))
    theirs.shutdown(socket.SHUT_WR)
    assert await framed.receive() == {"id": 1}
    with pytest.raises(anyio.EndOfStream):
        await framed.receive()


async def test_garbage_is_a_fatal_error(pair: tuple[FramedStream, socket.socket]) -> None:
    framed, theirs = pair
    theirs.sendall(b"\x00\x00\x00\x03\xc1\xc1\xc1")
    error = await receive_error(framed)
    assert (error.code, error.fatal) == (ErrorCode.BAD_FRAME, True)


async def test_send_to_a_peer_that_never_reads_times_out_then_stays_broken() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    framed = FramedStream(await UNIXSocketStream.from_socket(a), send_timeout_s=0.2, memfd_payloads=False)
    msg: dict[str, Any] = {"id": 1, "blob": b"x" * 60_000}
    with pytest.raises(TimeoutError):
        for _ in range(1000):  # the kernel buffer fills; nothing queues in this process
            await framed.send(msg)
    with pytest.raises(anyio.BrokenResourceError):
        await framed.send({"id": 2})
    await framed.aclose()
    b.close()


def test_create_segment_seals_its_memfd() -> None:
    fd = create_segment(b"abc")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals == SEALED | fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
    finally:
        os.close(fd)


def test_memfd_ref_layout_is_documented_bytes() -> None:
    packed = msgpack.packb(MemfdRef(2, 300, Dtype.INT32).to_ext())
    assert packed == b"\xc7\x0a\x01" + b"\x02" + (300).to_bytes(8, "big") + b"\x01"


def test_memfd_round_trip_on_uvloop() -> None:
    async def main() -> dict[str, Any]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        async with FramedStream(await UNIXSocketStream.from_socket(a)) as left:
            async with FramedStream(await UNIXSocketStream.from_socket(b)) as right:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(left.send, {"id": 1, "tokens": list(range(20_000))})
                    return await right.receive()

    anyio.run(anyio.sleep, 0, backend_options={"use_uvloop": True})  # uvloop's own lasting pipe
    baseline = open_fds()
    got = anyio.run(main, backend_options={"use_uvloop": True})
    assert got == {"id": 1, "tokens": list(range(20_000))}
    assert open_fds() == baseline


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.tuples(st.sampled_from([0, 900, 50_000, 70_000]), st.sampled_from([0, 66_000])), min_size=1, max_size=10))
def test_descriptors_reach_their_own_frames_for_any_mix(sizes: list[tuple[int, int]]) -> None:
    msgs = [{"id": i, "a": bytes([i]) * a, "b": bytes([i + 1]) * b} for i, (a, b) in enumerate(sizes)]

    async def main() -> list[dict[str, Any]]:
        x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        async with FramedStream(await UNIXSocketStream.from_socket(x)) as left:
            async with FramedStream(await UNIXSocketStream.from_socket(y)) as right:
                async with anyio.create_task_group() as tg:

                    async def send_all() -> None:
                        for msg in msgs:
                            await left.send(msg)

                    tg.start_soon(send_all)
                    await anyio.sleep(0.01)  # let frames pile up so one recvmsg spans several
                    return [await right.receive() for _ in msgs]

    baseline = open_fds()
    assert anyio.run(main) == msgs
    assert open_fds() == baseline
