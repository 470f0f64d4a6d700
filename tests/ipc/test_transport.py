"""FramedStream.send_many: a burst of replies goes out in one write, in order; a map with
descriptors is written on its own; a map that does not fit stops the burst after the maps
before it."""

from __future__ import annotations

import pytest

from prefixd.ipc.errors import ProtocolError
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
