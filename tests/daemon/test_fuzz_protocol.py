"""Issue 8: a property-based fuzzer over the wire protocol, against an in-process daemon
with the fake engine.

Each example opens a connection and sends a sequence of frames drawn from: raw bytes
(lengths included), garbage msgpack under a right length, maps of every request type with
fields of the wrong types, and generates whose fields are memfd references (bad indexes,
unsealed segments, wrong sizes, wrong dtypes). A status frame follows as a sentinel; the
example reads until it is answered or the daemon closes the connection. After each example
the daemon must answer a normal generate exactly as it did fresh, and lanes, pages, open
descriptors, connections and buffered bytes must be back at their baseline.
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
from typing import Any

import anyio
import msgpack
from anyio import from_thread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixd.front.bounds import ConnectionBounds
from prefixd.ipc.framing import Dtype, MemfdRef
from tests.daemon.harness import open_fds, running_server, wait_idle

SENTINEL_ID = 1 << 40
PROBE = {"type": "generate", "prompt": "probe", "max_tokens": 6, "cache": False, "namespace": "probe"}
SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE

FIELDS = ["id", "prompt", "tokens", "messages", "max_tokens", "sampling", "stop", "stop_ids", "chunk_starts",
          "namespace", "cache", "cache_key", "logits", "images", "versions", "client", "target", "text", "ids",
          "add_special", "bogus"]
TYPES = ["hello", "generate", "cancel", "status", "tokenize", "detokenize", "launch"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                    st.floats(allow_nan=True), st.text(max_size=12), st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.sampled_from(FIELDS + ["role", "content", "at"]),
                                                                       inner, max_size=4)),
                      max_leaves=12)
ids = st.one_of(st.integers(0, 20), values)


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def pack(msg: Any) -> bytes:
    return msgpack.packb(msg, use_bin_type=True, default=lambda ref: ref.to_ext())


@st.composite
def wrong_typed_maps(draw) -> tuple[bytes, list]:
    msg = {"type": draw(st.sampled_from(TYPES)), "id": draw(ids)}
    msg.update(draw(st.dictionaries(st.sampled_from(FIELDS), values, max_size=4)))
    return frame(pack(msg)), []


@st.composite
def honest_requests(draw) -> tuple[bytes, list]:
    request_id = draw(st.integers(0, 20))
    msg = draw(st.sampled_from([
        {"type": "generate", "prompt": "hi", "max_tokens": 3},
        {"type": "generate", "tokens": [5, 6, 7], "max_tokens": 50},
        {"type": "cancel", "target": 3},
        {"type": "detokenize", "ids": [100, 101]},
        {"type": "tokenize", "text": "abc"},
        {"type": "hello", "versions": [1]},
    ]))
    return frame(pack({**msg, "id": request_id})), []


@st.composite
def raw_bytes(draw) -> tuple[bytes, list]:
    return draw(st.one_of(
        st.binary(min_size=1, max_size=40),  # anything, lengths included
        st.binary(min_size=1, max_size=40).map(frame),  # garbage under a right length
        st.integers(0, 64).map(lambda n: struct.pack(">I", n)),  # a bare length prefix
    )), []


@st.composite
def memfd_refs(draw) -> tuple[bytes, list]:
    """A generate whose token or image fields point at memfds, right or wrong."""
    segments = draw(st.lists(st.tuples(st.binary(max_size=64), st.booleans()), max_size=3))
    ref = st.builds(MemfdRef, st.integers(0, 4), st.integers(0, 80), st.sampled_from(list(Dtype)))
    msg: dict[str, Any] = {"type": "generate", "id": draw(st.integers(0, 20)), "max_tokens": 4}
    field = draw(st.sampled_from(["tokens", "images", "stop_ids", "unknown"]))
    if field == "images":
        msg["tokens"] = [5] * 8
        msg["images"] = [{"at": 0, "tokens": draw(st.integers(1, 2)), "gh": 1, "gw": 1, "hash": b"h",
                          "rows": draw(ref)}]
    else:
        msg[field] = draw(ref)
        msg.setdefault("tokens", [5, 6])
    return frame(pack(msg)), segments


examples = st.lists(st.one_of(raw_bytes(), wrong_typed_maps(), honest_requests(), memfd_refs()),
                    min_size=1, max_size=4)


def memfd(content: bytes, sealed: bool) -> int:
    fd = os.memfd_create("fuzz", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.write(fd, content)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED)
    return fd


def send(sock: socket.socket, data: bytes, segments: list[tuple[bytes, bool]]) -> None:
    """`data`, with memfds of `segments` riding on its first byte (closed here once sent)."""
    fds = [memfd(content, sealed) for content, sealed in segments]
    try:
        if fds:
            sock.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            data = data[1:]
        sock.sendall(data)
    finally:
        for fd in fds:
            os.close(fd)


def read_until_sentinel(sock: socket.socket) -> list[dict]:
    """Frames until the sentinel status is answered or the daemon closes the connection."""
    frames: list[dict] = []
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except (ConnectionResetError, BrokenPipeError):
            return frames
        if not chunk:
            return frames
        frames.extend(_split(sock, chunk))
        if any(f.get("type") == "status" and f.get("id") == SENTINEL_ID for f in frames):
            return frames


_pending: dict[int, bytes] = {}


def _split(sock: socket.socket, chunk: bytes) -> list[dict]:
    buf = _pending.pop(sock.fileno(), b"") + chunk
    out = []
    while len(buf) >= 4 and len(buf) >= 4 + (n := struct.unpack(">I", buf[:4])[0]):
        out.append(msgpack.unpackb(buf[4:4 + n], raw=False, strict_map_key=False))
        buf = buf[4 + n:]
    _pending[sock.fileno()] = buf
    return out


def generate_text(path: str, request: dict) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)  # a liveness bound, not a timing assertion
        sock.connect(path)
        sock.sendall(frame(pack({**request, "id": 1})))
        frames: list[dict] = []
        while not frames or frames[-1].get("type") not in ("done", "error"):
            chunk = sock.recv(1 << 16)
            assert chunk, f"the daemon closed the probe's connection after {frames}"
            frames.extend(_split(sock, chunk))
        _pending.pop(sock.fileno(), None)
    assert frames[-1]["type"] == "done", frames[-1]
    return "".join(f["text"] for f in frames if f["type"] == "token")


def run_example(server: Any, baseline: tuple[str, set[int]], sequence: list[tuple[bytes, list[tuple[bytes, bool]]]]) -> None:
    """One example, on a worker thread while the daemon runs on the event loop."""
    path = str(server.socket_path)
    expected_text, expected_fds = baseline
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)  # a liveness bound, not a timing assertion
        sock.connect(path)
        try:
            for data, segments in sequence:
                send(sock, data, segments)
            send(sock, frame(pack({"type": "status", "id": SENTINEL_ID})), [])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed this connection: what it should do for broken framing
        frames = read_until_sentinel(sock)
        _pending.pop(sock.fileno(), None)
    for reply in frames:
        if reply.get("type") == "error":
            assert reply["id"] is None or (type(reply["id"]) is int and 0 <= reply["id"] < 1 << 63)
            assert reply["code"] != "internal", reply

    assert not server.should_exit, server._out.getvalue()
    assert generate_text(path, PROBE) == expected_text
    status = from_thread.run(wait_idle, server)  # also checks the engine's integrity
    assert (status["lanes_busy"], status["waiting"]) == (0, 0)
    assert status["pages_free"] + status["pages_used"] == 256  # check_integrity audits who holds them
    while server._connections:  # the example's connection is gone once its task ends
        from_thread.run(anyio.sleep, 0.01)
    assert server.buffers.used_bytes == 0
    assert open_fds() ^ expected_fds == set()


async def test_no_frame_sequence_changes_what_the_daemon_does_for_others(tmp_path):
    bounds = ConnectionBounds(frame_deadline_s=0.2, max_buffered_bytes=1 << 20)
    async with running_server(tmp_path, bounds=bounds) as server:
        await wait_idle(server)
        text = await anyio.to_thread.run_sync(generate_text, str(server.socket_path), PROBE)
        assert text == "efghij"  # the fake device's letters after a 5-byte prompt
        while server._connections:
            await anyio.sleep(0.01)
        baseline = (text, open_fds())

        @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(sequence=examples)
        def fuzz(sequence: list[tuple[bytes, list[tuple[bytes, bool]]]]) -> None:
            run_example(server, baseline, sequence)

        await anyio.to_thread.run_sync(fuzz)
