"""Issue 8, defects 2 and 6: the accept loop outlives descriptor exhaustion; slow, idle and
surplus clients are bounded (frame deadline, connection cap, shared frame buffers), all
through the socket, with small bounds injected."""

from __future__ import annotations

import os
import resource
import socket
import struct

import anyio
import msgpack

from prefixd.front.bounds import ConnectionBounds
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.framing import encode_frame
from prefixd.ipc.transport import FramedStream
from tests.daemon.harness import fds_once_closed, open_fds, running_server, wait_idle


async def _read_until_closed(stream: anyio.abc.ByteStream) -> list[dict]:
    """Every frame the daemon sends until it closes the connection."""
    frames, buf = [], b""
    with anyio.fail_after(10):  # a liveness bound, not a timing assertion
        while True:
            try:
                buf += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return frames
            while len(buf) >= 4 and len(buf) >= 4 + (n := struct.unpack(">I", buf[:4])[0]):
                frames.append(msgpack.unpackb(buf[4:4 + n], raw=False))
                buf = buf[4 + n:]


async def _status_ok(server) -> None:
    async with await AsyncClient.connect(server.socket_path) as client:
        assert (await client.status())["shutting_down"] is False


async def test_accept_outlives_descriptor_exhaustion(tmp_path):
    bounds = ConnectionBounds(accept_backoff_s=0.01)
    async with running_server(tmp_path, bounds=bounds) as server:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # made before the fds run out
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fillers: list[int] = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(open_fds()) + 16, hard))
        try:
            while True:
                try:
                    fillers.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    break
            client.connect(str(server.socket_path))  # queued; the daemon's accept gets EMFILE
            await anyio.sleep(0.2)  # several failed accepts happen here
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        client.setblocking(False)
        async with await anyio.abc.UNIXSocketStream.from_socket(client) as raw:
            framed = FramedStream(raw)
            await framed.send({"type": "status", "id": 1})
            with anyio.fail_after(10):
                reply = await framed.receive()
            assert (reply["type"], reply["id"]) == ("status", 1)
        await _status_ok(server)


async def test_a_trickled_frame_is_closed_at_its_deadline_and_an_idle_connection_is_not(tmp_path):
    bounds = ConnectionBounds(frame_deadline_s=0.3)
    async with running_server(tmp_path, bounds=bounds) as server:
        before = open_fds()
        async with await anyio.connect_unix(server.socket_path) as idle:
            trickler = await anyio.connect_unix(server.socket_path)
            async with trickler:
                await trickler.send(struct.pack(">I", 1000) + b"\x81")
                frames = await _read_until_closed(trickler)
            assert [(f["code"], f["id"]) for f in frames] == [("frame_timeout", None)]
            await anyio.sleep(0.5)  # longer than the deadline, between frames
            framed = FramedStream(idle)
            await framed.send({"type": "status", "id": 2})
            assert (await framed.receive())["id"] == 2
        await wait_idle(server)
        assert server.buffers.used_bytes == 0
        assert await fds_once_closed(server) == before


async def test_the_connection_over_the_cap_gets_a_clear_error(tmp_path):
    async with running_server(tmp_path, bounds=ConnectionBounds(max_connections=2)) as server:
        async with await AsyncClient.connect(server.socket_path) as first:
            async with await AsyncClient.connect(server.socket_path) as second:
                await first.status()
                await second.status()  # both are served, so both are counted
                async with await anyio.connect_unix(server.socket_path) as third:
                    frames = await _read_until_closed(third)
                assert frames == [{"type": "error", "id": None, "code": "too_many_connections",
                                   "message": "the daemon already serves 2 connections; try again later"}]
            while len(server._connections) > 1:
                await anyio.sleep(0.01)
            await _status_ok(server)  # the second one's seat is free again


async def test_a_frame_waits_for_room_in_the_shared_buffers(tmp_path):
    hello = encode_frame({"type": "hello", "id": 3, "versions": [1], "client": "x" * 2000})
    bounds = ConnectionBounds(max_buffered_bytes=4096, frame_deadline_s=30.0)
    async with running_server(tmp_path, bounds=bounds) as server:
        async with await anyio.connect_unix(server.socket_path) as holder, \
                await anyio.connect_unix(server.socket_path) as waiter:
            held = encode_frame({"type": "status", "id": 1, "pad": "y" * 3000})
            await holder.send(held[:10])
            while server.buffers.used_bytes < len(held):
                await anyio.sleep(0.01)
            await waiter.send(hello[:10])
            while not any(c.framed.buffered_bytes for c in server._connections if c.framed is not None
                          and c.framed.reserved_bytes == 0):
                await anyio.sleep(0.01)
            await waiter.send(hello[10:])
            assert server.buffers.used_bytes == len(held)  # the waiter holds nothing yet
            await holder.send(held[10:])  # completes: its room goes to the waiter
            holder_framed, waiter_framed = FramedStream(holder), FramedStream(waiter)
            assert (await holder_framed.receive())["code"] == "bad_request"  # "pad" is no status field
            assert (await waiter_framed.receive())["type"] == "hello"
        while server._connections:
            await anyio.sleep(0.01)
        assert server.buffers.used_bytes == 0


async def test_a_frame_larger_than_all_buffers_is_refused_at_once(tmp_path):
    async with running_server(tmp_path, bounds=ConnectionBounds(max_buffered_bytes=4096)) as server:
        async with await anyio.connect_unix(server.socket_path) as stream:
            await stream.send(struct.pack(">I", 5000) + b"\x81")
            frames = await _read_until_closed(stream)
        assert [(f["code"], f["id"]) for f in frames] == [("busy", None)]
        await _status_ok(server)
        assert server.buffers.used_bytes == 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_memory_of_slow_clients_is_returned_after_they_close(tmp_path):
    frame_bytes = 4 << 20
    async with running_server(tmp_path) as server:
        await _status_ok(server)
        rss_before = _rss_bytes()
        streams = [await anyio.connect_unix(server.socket_path) for _ in range(8)]
        for stream in streams:
            await stream.send(struct.pack(">I", frame_bytes) + b"\x00" * (frame_bytes - 1))
        while sum(c.framed.buffered_bytes for c in server._connections) < 8 * frame_bytes:
            await anyio.sleep(0.01)
        assert _rss_bytes() - rss_before > 16 << 20  # the slow clients' bytes are held
        for stream in streams:
            await stream.aclose()
        while server._connections:
            await anyio.sleep(0.01)
        assert server.buffers.used_bytes == 0
        assert _rss_bytes() - rss_before < 8 << 20  # and given back, not kept by the allocator
