"""Big socket frames (a read completing ConnectionBounds.off_loop_bytes of frames) are decoded
on a worker thread: through a real daemon, big frames good and bad beside an honest client
leave its ids and logits digests as they are alone, and leave no connection, stream or
descriptor behind."""

from __future__ import annotations

import socket
import struct

import anyio
import msgpack

from prefixd.front.bounds import OFF_LOOP_BYTES
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.framing import FrameDecoder
from tests.daemon.harness import fds_once_closed, honest_beside, running_server, wait_idle

PAD = "x" * (OFF_LOOP_BYTES + 1024)  # makes any frame big


def _deep(levels: int) -> object:
    node: object = 1
    for _ in range(levels):
        node = [node]
    return node


BAD_FRAMES = [  # each big, each a framing error: nested too deep, a map key that is not a string
    msgpack.packb({"type": "tokenize", "id": 1, "text": PAD, "deep": _deep(12)}),
    msgpack.packb({"type": "tokenize", "id": 2, "text": PAD, "m": {1: 2}}),
]


def _send_bad(path: str, body: bytes) -> dict:
    """Send one bad frame on a connection of its own; the daemon's answer before it closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        sock.sendall(struct.pack(">I", len(body)) + body)
        data = b""
        while chunk := sock.recv(1 << 16):  # the daemon closes the connection after its answer
            data += chunk
    (answer,) = FrameDecoder().feed(data)
    return answer


async def test_big_frames_good_and_bad_beside_an_honest_client_leave_its_bits_unchanged(tmp_path, monkeypatch):
    decoded_off_loop = []
    real = anyio.to_thread.run_sync

    async def counting(fn, *args, **kwargs):
        if getattr(fn, "__func__", None) is FrameDecoder.feed_fds:
            decoded_off_loop.append(len(args[0]))
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
    prompts = [f"honest {i} " * 3 for i in range(6)]
    async with running_server(tmp_path) as server:
        path = str(server.socket_path)

        async def honest() -> list[tuple]:
            async with await AsyncClient.connect(path) as client:
                return [((r := await client.generate(prompt=p, max_tokens=8, logits=True, cache=False).collect()).ids,
                         r.logits_sha256) for p in prompts]

        alone = await honest()
        async with await AsyncClient.connect(path) as client:  # starts the render workers the big one uses,
            await client.tokenize(text=PAD)                     # kept for the daemon's life
        fds_before = await fds_once_closed(server)
        answers: list[dict] = []
        big_tokens: list[int] = []

        async def hostile() -> None:
            for _ in range(4):
                async with await AsyncClient.connect(path) as client:
                    big_tokens.append(len((await client.tokenize(text=PAD)).ids))  # a good big frame
                for body in BAD_FRAMES:
                    answers.append(await anyio.to_thread.run_sync(_send_bad, path, body))

        assert await honest_beside(hostile, honest) == alone
        assert big_tokens == [len(PAD)] * 4  # the letters tokenizer: a token a character
        assert [a["type"] for a in answers] == ["error"] * 8
        assert [a["code"] for a in answers] == ["bad_frame"] * 8
        assert any("nesting deeper" in a["message"] for a in answers)
        assert any("map key" in a["message"] for a in answers)
        assert len(decoded_off_loop) >= 13  # each big frame's last read: 5 good, 8 bad
        status = await wait_idle(server)
        assert status["lanes_busy"] == 0 and server.link.num_open_streams == 0
        assert await fds_once_closed(server) == fds_before
