"""Issue 3 item 8: every kind of bad input gets a clear error or a clean close of that one
connection; the daemon keeps serving others; lanes, pages and fds return to idle."""

from __future__ import annotations

import os
import socket
import struct

import anyio
import msgpack
import pytest

from prefixd.ipc.client import AsyncClient
from prefixd.ipc.framing import Dtype, MemfdRef, encode_frame
from prefixd.ipc.transport import FramedStream
from tests.daemon.fakes import LetterDevice
from tests.daemon.harness import fds_once_closed, open_fds, running_server, wait_idle


async def _raw_session(path, data: bytes, fds: list[int] | None = None) -> list[dict]:
    """Send raw bytes (and fds), then read frames until the daemon closes or goes quiet."""
    stream = await anyio.connect_unix(path)
    frames: list[dict] = []
    async with stream:
        if fds:
            await stream.send_fds(data, fds)
        elif data:
            await stream.send(data)
        unpacker = msgpack.Unpacker(raw=False)
        buf = b""
        with anyio.move_on_after(5):  # a liveness bound, not an assertion
            while True:
                try:
                    chunk = await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    frames.append({"closed": True})
                    break
                buf += chunk
                while len(buf) >= 4:
                    (n,) = struct.unpack(">I", buf[:4])
                    if len(buf) < 4 + n:
                        break
                    frames.append(msgpack.unpackb(buf[4:4 + n], raw=False))
                    buf = buf[4 + n:]
                if frames and frames[-1].get("type") in ("error", "status", "done"):
                    if not frames[-1].get("type") == "error" or frames[-1].get("id") is not None:
                        break
    return frames


async def _still_serves(server) -> None:
    async with await AsyncClient.connect(server.socket_path) as client:
        result = await client.generate(prompt="ok", max_tokens=2).collect()
    assert result.text == "bc"


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", "bad_frame"),  # garbage msgpack
        (b"\x00\x00\x00\x03\x93\x01\x02", "bad_frame"),  # a frame that is not a map
        (b"\x7f\xff\xff\xff", "frame_too_large"),  # oversized length prefix, nothing after it
    ],
)
async def test_broken_framing_closes_only_that_connection(tmp_path, data, code):
    async with running_server(tmp_path) as server:
        before = open_fds()
        frames = await _raw_session(server.socket_path, data)
        assert frames[0] == {"type": "error", "id": None, "code": code, "message": frames[0]["message"]}
        assert frames[-1] == {"closed": True}
        await _still_serves(server)
        await wait_idle(server)
        assert await fds_once_closed(server) == before


async def test_truncated_frame_then_close_is_a_clean_close(tmp_path):
    async with running_server(tmp_path) as server:
        before = open_fds()
        frames = await _raw_session(server.socket_path, b"\x00\x00\x01\x00" + b"\x81" * 10)
        assert frames in ([], [{"closed": True}]) or frames[0]["code"] == "bad_frame"
        await _still_serves(server)
        await wait_idle(server)
        assert await fds_once_closed(server) == before


@pytest.mark.parametrize(
    ("msg", "code", "needle"),
    [
        ({"type": "launch", "id": 1}, "unknown_type", "launch"),
        ({"type": "generate", "id": 1, "prompt": 5}, "bad_request", "prompt"),
        ({"type": "generate", "id": 1, "prompt": "x", "max_tokens": "many"}, "bad_request", "max_tokens"),
        ({"type": "generate", "id": 1, "prompt": "x", "max_tokens": 0}, "bad_request", "max_tokens"),
        ({"type": "generate", "id": 1, "prompt": "x", "max_tokens": -3}, "bad_request", "max_tokens"),
        ({"type": "generate", "id": 1, "tokens": [5, 259]}, "invalid_token", "259"),
        ({"type": "generate", "id": 1, "tokens": [5, -1]}, "invalid_token", "-1"),
        ({"type": "generate", "id": 1, "tokens": [5] * 300}, "context_overflow", "300"),
        ({"type": "generate", "id": 1, "prompt": "x", "stop_ids": [999]}, "invalid_token", "stop_ids"),
        ({"type": "detokenize", "id": 1, "ids": [100000]}, "invalid_token", "100000"),
        ({"type": "hello", "id": 1, "versions": [7]}, "unsupported_version", "7"),
        ({"type": "cancel", "id": 1, "target": 99}, "not_found", "99"),
        ({"type": "status"}, "bad_request", "id"),
    ],
)
async def test_bad_requests_get_an_error_and_the_connection_goes_on(tmp_path, msg, code, needle):
    async with running_server(tmp_path) as server:
        async with await FramedStream.connect(server.socket_path) as framed:
            await framed.send(msg)
            reply = await framed.receive()
            assert reply["type"] == "error"
            assert reply["code"] == code
            assert needle in reply["message"]
            await framed.send({"type": "status", "id": 2})
            status = await framed.receive()
            assert (status["type"], status["id"]) == ("status", 2)
        await wait_idle(server)


def _memfd(data: bytes, *, seal: bool) -> int:
    fd = os.memfd_create("forged", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.write(fd, data)
    if seal:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
    return fd


@pytest.mark.parametrize(("declared", "seal"), [(4 * 10, True), (4 * 3, False)])
async def test_forged_memfd_is_bad_payload_and_leaks_no_fd(tmp_path, declared, seal):
    async with running_server(tmp_path) as server:
        before = open_fds()
        fd = _memfd(struct.pack("<3i", 5, 6, 7), seal=seal)
        ref = MemfdRef(0, declared, Dtype.INT32).to_ext()
        body = msgpack.packb({"type": "generate", "id": 4, "tokens": ref}, use_bin_type=True)
        try:
            frames = await _raw_session(server.socket_path, struct.pack(">I", len(body)) + body, [fd])
        finally:
            os.close(fd)
        assert frames[0]["type"] == "error"
        assert frames[0]["code"] == "bad_payload"
        await _still_serves(server)
        await wait_idle(server)
        assert await fds_once_closed(server) == before


async def test_disconnect_mid_stream_cancels_its_streams(tmp_path):
    async with running_server(tmp_path, LetterDevice(round_delay_s=0.002)) as server:
        before = open_fds()
        framed = await FramedStream.connect(server.socket_path)
        for i in range(3):
            await framed.send({"type": "generate", "id": i, "prompt": "go", "max_tokens": 100000})
        first = await framed.receive()
        assert first["type"] == "token"
        await framed.aclose()
        status = await wait_idle(server)
        assert status["lanes_busy"] == 0 and status["waiting"] == 0
        assert status["pages_used"] == sum(lane["pages"] for lane in status["lanes"])
        await _still_serves(server)
        await wait_idle(server)
        assert await fds_once_closed(server) == before


async def test_a_client_that_never_reads_is_disconnected_and_its_stream_cancelled(tmp_path):
    device = LetterDevice(num_pages=1 << 14, max_context=1 << 15)
    async with running_server(tmp_path, device, out_frames=8) as server:
        before = open_fds()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(str(server.socket_path))
        sock.sendall(encode_frame({"type": "generate", "id": 1, "tokens": [10], "max_tokens": 30000, "logits": True}))
        # never read: the daemon must give up on this connection by itself
        while any(True for _ in server._connections):
            await anyio.sleep(0.01)
        status = await wait_idle(server)
        assert status["lanes_busy"] == 0
        await _still_serves(server)
        sock.close()
        await wait_idle(server)
        assert await fds_once_closed(server) == before


async def test_a_bug_in_one_request_closes_only_that_connection(tmp_path, monkeypatch):
    from prefixd.front.requests import RequestBuilder

    def broken(self, msg):
        raise RuntimeError("planted bug")

    monkeypatch.setattr(RequestBuilder, "detokenize", broken)
    async with running_server(tmp_path) as server:
        frames = await _raw_session(server.socket_path, encode_frame({"type": "detokenize", "id": 1, "ids": [5]}))
        assert frames == [{"closed": True}]
        await _still_serves(server)
        await wait_idle(server)


async def test_too_many_streams_on_one_connection_is_refused(tmp_path):
    async with running_server(tmp_path, LetterDevice(round_delay_s=0.002), max_streams=2) as server:
        async with await FramedStream.connect(server.socket_path) as framed:
            for i in range(3):
                await framed.send({"type": "generate", "id": i, "prompt": "x", "max_tokens": 100000})
            while (reply := await framed.receive())["type"] != "error":
                assert reply["type"] == "token"
            assert (reply["id"], reply["code"]) == (2, "too_many_streams")
        await wait_idle(server)


# -- issue 8: ids, descriptors, backpressure, memfd payloads ---------------------------------


@pytest.mark.parametrize("bad_id", [-5, True, 1 << 63, 2.0, "7"])
async def test_an_error_reply_never_repeats_an_invalid_id(tmp_path, bad_id):
    async with running_server(tmp_path) as server:
        async with await FramedStream.connect(server.socket_path) as framed:
            await framed.send({"type": "launch", "id": bad_id})
            reply = await framed.receive()
            assert (reply["type"], reply["id"], reply["code"]) == ("error", None, "unknown_type")
            await framed.send({"type": "cancel", "id": bad_id, "target": 1})
            reply = await framed.receive()
            assert (reply["id"], reply["code"]) == (None, "bad_request")


async def test_more_descriptors_than_allowed_close_that_connection_and_leak_none(tmp_path):
    async with running_server(tmp_path) as server:
        before = open_fds()
        fds = [_memfd(b"abcd", seal=True) for _ in range(server.limits.max_fds_per_frame + 1)]
        try:
            frames = await _raw_session(server.socket_path, encode_frame({"type": "status", "id": 1}), fds)
        finally:
            for fd in fds:
                os.close(fd)
        assert frames[0] == {"type": "error", "id": None, "code": "bad_frame",
                             "message": "9 descriptors for one frame exceed 8"}
        assert frames[-1] == {"closed": True}
        await _still_serves(server)
        await wait_idle(server)
        assert await fds_once_closed(server) == before


async def test_600_frames_in_one_write_are_all_answered_to_a_reading_client(tmp_path):
    async with running_server(tmp_path, out_frames=16) as server:
        data = b"".join(
            encode_frame({"type": "detokenize", "id": i, "ids": [3 + 97]} if i % 2 else
                         {"type": "cancel", "id": i, "target": 100000 + i})
            for i in range(600)
        )
        async with await FramedStream.connect(server.socket_path) as framed:
            await framed.stream.send(data)
            replies = [await framed.receive() for _ in range(600)]
            assert [r["id"] for r in replies] == list(range(600))
            assert [r["type"] for r in replies] == ["error", "text"] * 300
            assert replies[1]["text"] == "a"
            assert replies[0]["code"] == "not_found"
        await wait_idle(server)


def _sparse_memfd(num_bytes: int, *, seal: bool = True) -> int:
    """A sealed memfd of `num_bytes` zero bytes that costs no memory until someone reads it."""
    import fcntl

    fd = os.memfd_create("sparse", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, num_bytes)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    return fd


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


async def _send_refs(server, fields: dict, fds: list[int]) -> list[dict]:
    msg = {"type": "generate", "id": 4, **{k: v.to_ext() for k, v in fields.items()}}
    body = msgpack.packb(msg, use_bin_type=True)
    try:
        return await _raw_session(server.socket_path, struct.pack(">I", len(body)) + body, fds)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize(
    ("extra", "code", "needle"),
    [
        ({"junk_a": 1, "junk_b": 2}, "bad_request", "junk_a: unknown field"),  # the case
        ({}, "context_overflow", "16777216 tokens exceed the context of 256"),
    ],
)
async def test_three_64_mib_segments_are_refused_before_any_is_read(tmp_path, extra, code, needle):
    size = 64 << 20
    async with running_server(tmp_path) as server:
        before = open_fds()
        fields = {"tokens": MemfdRef(0, size, Dtype.INT32)}
        fields.update({name: MemfdRef(i, size, Dtype.BYTES) for name, i in extra.items()})
        fds = [_sparse_memfd(size) for _ in range(1 + len(extra))]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
        rss_kib = _rss_kib("VmRSS")
        frames = await _send_refs(server, fields, fds)
        peak_growth_kib = _rss_kib("VmHWM") - rss_kib
        assert (frames[0]["id"], frames[0]["code"]) == (4, code)
        assert needle in frames[0]["message"]
        assert peak_growth_kib < 32 << 10  # nothing near one 64 MiB segment was ever held
        await _still_serves(server)
        await wait_idle(server)
        assert await fds_once_closed(server) == before


async def test_an_unknown_field_is_refused_before_its_segment_is_checked(tmp_path):
    async with running_server(tmp_path) as server:
        fd = _sparse_memfd(16, seal=False)  # unsealed: reading it would be bad_payload
        frames = await _send_refs(server, {"zz": MemfdRef(0, 16, Dtype.BYTES)}, [fd])
        assert frames[0] == {"type": "error", "id": 4, "code": "bad_request", "message": "zz: unknown field"}


async def test_memfd_token_ids_generate_what_inline_ids_generate(tmp_path):
    ids = [3 + b for b in b"hello"]
    async with running_server(tmp_path) as server:
        fd = _memfd(struct.pack(f"<{len(ids)}i", *ids), seal=True)
        frames = await _send_refs(server, {"tokens": MemfdRef(0, 4 * len(ids), Dtype.INT32)}, [fd])
        via_memfd = "".join(f.get("text", "") for f in frames if f.get("type") == "token")
        assert frames[-1]["type"] == "done"
        async with await AsyncClient.connect(server.socket_path) as client:
            inline = await client.generate(tokens=ids, max_tokens=frames[-1]["usage"]["completion_tokens"],
                                           cache=False).collect()
        assert via_memfd == inline.text
        assert via_memfd.startswith("efghij")
        await wait_idle(server)


@pytest.mark.parametrize(
    ("field", "ids", "code", "message"),
    [
        ("tokens", [5, 300, 6], "invalid_token", "token id 300 is outside the vocabulary [0, 259)"),
        ("tokens", [5, -2], "invalid_token", "tokens: -2 outside [0, 2147483647]"),
        ("messages", [5], "bad_request", "messages: must be an array, got int32 memfd array"),
    ],
)
async def test_memfd_int32_arrays_are_range_and_type_checked(tmp_path, field, ids, code, message):
    async with running_server(tmp_path) as server:
        fd = _memfd(struct.pack(f"<{len(ids)}i", *ids), seal=True)
        fields = {field: MemfdRef(0, 4 * len(ids), Dtype.INT32)}
        frames = await _send_refs(server, fields, [fd])
        assert (frames[0]["id"], frames[0]["code"]) == (4, code)
        assert message in frames[0]["message"]
