"""Frames: limits enforced before allocation, incremental decoding, malformed input."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.framing import HEADER_BYTES, Dtype, FrameDecoder, Limits, MemfdRef, decode_body, encode_frame


def frame_of(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def decode_error(data: bytes, limits: Limits | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        FrameDecoder(limits).feed(data)
    return info.value


def test_encode_frame_is_big_endian_length_then_msgpack_map() -> None:
    data = encode_frame({"type": "status", "id": 7})
    body = msgpack.packb({"type": "status", "id": 7})
    assert data == len(body).to_bytes(4, "big") + body
    assert data[:4] == b"\x00\x00\x00\x11"  # 17 bytes of msgpack


def test_default_limits_are_the_documented_ones() -> None:
    assert Limits().to_wire() == {
        "max_frame_bytes": 8 << 20, "max_str_bytes": 1 << 20, "max_bin_bytes": 4 << 20,
        "max_array_len": 1 << 20, "max_map_len": 256, "max_depth": 8, "max_fds_per_frame": 8,
        "max_memfd_bytes": 64 << 20, "max_payload_bytes": 128 << 20, "memfd_threshold_bytes": 64 << 10,
    }


def test_oversized_length_prefix_fails_on_its_four_bytes_alone() -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError) as info:
        decoder.feed(((8 << 20) + 1).to_bytes(4, "big"))
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    assert info.value.fatal
    assert decoder.buffered_bytes == 0  # nothing of the announced body was buffered


def test_frame_of_exactly_max_bytes_is_accepted() -> None:
    limits = Limits(max_frame_bytes=64)
    body = msgpack.packb({"s": "x" * 59})
    assert len(body) == 64
    assert FrameDecoder(limits).feed(frame_of(body)) == [{"s": "x" * 59}]
    assert decode_error(frame_of(msgpack.packb({"s": "x" * 60})), limits).code is ErrorCode.FRAME_TOO_LARGE


def test_decoder_keeps_raising_after_an_error() -> None:
    decoder = FrameDecoder()
    for _ in range(2):
        with pytest.raises(ProtocolError) as info:
            decoder.feed(b"\xff\xff\xff\xff")
        assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_huge_array_header_is_refused_before_allocation() -> None:
    # An array32 header announcing 2**32-1 elements in a 9-byte body.
    body = b"\x81\xa1a" + b"\xdd\xff\xff\xff\xff" + b"\x00"
    error = decode_error(frame_of(body))
    assert error.code is ErrorCode.BAD_FRAME
    assert "max_array_len" in error.message


@pytest.mark.parametrize(
    ("value", "limit"),
    [
        ("x" * ((1 << 20) + 1), "max_str_len"),
        (b"x" * ((4 << 20) + 1), "max_bin_len"),
        ({str(i): 0 for i in range(257)}, "max_map_len"),
    ],
)
def test_str_bin_map_over_their_limits_are_refused(value: object, limit: str) -> None:
    error = decode_error(encode_frame({"a": value}))
    assert error.code is ErrorCode.BAD_FRAME
    assert limit in error.message


def test_values_at_their_limits_are_accepted() -> None:
    msg = {"s": "x" * (1 << 20), "b": b"x" * (4 << 20), "m": {str(i): 0 for i in range(256)}}
    assert FrameDecoder().feed(encode_frame(msg)) == [msg]


def test_nesting_deeper_than_max_depth_is_refused() -> None:
    nested: object = 1
    for _ in range(8):
        nested = [nested]
    ok = {"a": nested}  # map + 7 arrays... depth 9 holds the scalar; containers reach 9
    error = decode_error(encode_frame(ok))
    assert error.code is ErrorCode.BAD_FRAME and "nesting" in error.message
    assert FrameDecoder().feed(encode_frame({"a": [[[[[[[1]]]]]]]})) == [{"a": [[[[[[[1]]]]]]]}]


def test_very_deep_nesting_is_a_protocol_error() -> None:
    body = b"\x81\xa1a" + b"\x91" * 100_000 + b"\x00"
    assert decode_error(frame_of(body)).code is ErrorCode.BAD_FRAME


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (msgpack.packb([1, 2]), "holds a map"),
        (msgpack.packb({1: 2}), "undecodable"),
        (msgpack.packb({"a": 1}) + b"\x00", "undecodable"),  # extra bytes inside the frame
        (b"\x81\xa1a", "undecodable"),  # truncated map
        (b"\xc1", "undecodable"),  # reserved byte
        (b"\x81\xa1a\xa2\xff\xfe", "undecodable"),  # invalid UTF-8
        (msgpack.packb({"a": msgpack.ExtType(5, b"x")}), "unknown ext type 5"),
        (msgpack.packb({"a": msgpack.ExtType(1, b"short")}), "memfd ref of 5 bytes"),
        (b"\x81\xa1a\xd6\xff\x00\x00\x00\x00", "unsupported value type Timestamp"),
        (msgpack.packb({"a": {b"k": 1}}), "map keys must be strings"),
    ],
)
def test_malformed_bodies_are_bad_frame(body: bytes, why: str) -> None:
    error = decode_error(frame_of(body))
    assert error.code is ErrorCode.BAD_FRAME
    assert why in error.message


def test_empty_frame_is_bad_frame() -> None:
    assert decode_error(b"\x00\x00\x00\x00").code is ErrorCode.BAD_FRAME


def test_memfd_ref_round_trips_as_ext_value() -> None:
    ref = MemfdRef(3, 1 << 33, Dtype.FLOAT32)
    data = encode_frame({"rows": ref})
    assert msgpack.unpackb(data[HEADER_BYTES:]) == {"rows": msgpack.ExtType(1, b"\x03" + (1 << 33).to_bytes(8, "big") + b"\x02")}
    assert decode_body(data[HEADER_BYTES:], Limits()) == ({"rows": ref}, 1)


def test_encode_frame_refuses_a_body_over_the_limit() -> None:
    with pytest.raises(ProtocolError) as info:
        encode_frame({"s": "x" * 100}, Limits(max_frame_bytes=64))
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_byte_by_byte_feeding_yields_frames_at_their_last_byte() -> None:
    data = encode_frame({"id": 1}) + encode_frame({"id": 2, "ids": [1, 2, 3]})
    decoder = FrameDecoder()
    out = [decoder.feed(data[i : i + 1]) for i in range(len(data))]
    first_end = len(encode_frame({"id": 1}))
    assert out[first_end - 1] == [{"id": 1}]
    assert out[-1] == [{"id": 2, "ids": [1, 2, 3]}]
    assert sum(len(x) for x in out) == 2
    assert decoder.buffered_bytes == 0


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20,
)
maps = st.dictionaries(st.text(max_size=8), values, max_size=6)


def depth_of(node: object) -> int:
    if isinstance(node, dict):
        return 1 + max((depth_of(v) for v in node.values()), default=0)
    if isinstance(node, list):
        return 1 + max((depth_of(v) for v in node), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(msgs=st.lists(maps, min_size=1, max_size=4), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_valid_frames_round_trip_under_any_split(msgs: list[dict], cuts: list[int]) -> None:
    msgs = [m for m in msgs if depth_of(m) <= 8]
    data = b"".join(encode_frame(m) for m in msgs)
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    decoder = FrameDecoder()
    out: list[dict] = []
    for a, b in zip(bounds, bounds[1:]):
        out += decoder.feed(data[a:b])
    assert out == msgs
    assert decoder.buffered_bytes == 0


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=6))
def test_arbitrary_bytes_yield_maps_or_protocol_error(data: bytes, cuts: list[int]) -> None:
    limits = Limits(max_frame_bytes=256)
    decoder = FrameDecoder(limits)
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    try:
        for a, b in zip(bounds, bounds[1:]):
            for msg in decoder.feed(data[a:b]):
                assert type(msg) is dict
            # Memory stays bounded: at most one frame in progress.
            assert decoder.buffered_bytes <= HEADER_BYTES + limits.max_frame_bytes
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(min_size=1, max_size=64))
def test_arbitrary_bodies_in_well_formed_frames_decode_to_maps_or_raise(body: bytes) -> None:
    try:
        frames = FrameDecoder().feed(frame_of(body))
    except ProtocolError as exc:
        assert exc.fatal
    else:
        assert len(frames) == 1 and type(frames[0]) is dict
