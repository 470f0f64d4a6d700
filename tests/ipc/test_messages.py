"""Messages: every request and event round-trips; validation errors name their field."""

from __future__ import annotations

from typing import Any

import pytest

from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.framing import FrameDecoder, encode_frame
from prefixd.ipc.messages import (
    Cancel,
    Detokenize,
    DoneEvent,
    ErrorReply,
    Generate,
    Hello,
    HelloReply,
    Image,
    OkReply,
    Sampling,
    Status,
    StatusReply,
    TextReply,
    TokenEvent,
    Tokenize,
    TokensReply,
    Usage,
    parse_event,
    parse_request,
)

IMAGE = Image(at=2, tokens=2, gh=1, gw=2, hash=b"\x01" * 32, rows=bytes(range(16)))
REQUESTS = [
    Hello(1, (1, 2), "test-client"),
    Hello(2),
    Generate(3, prompt="Hello"),
    Generate(
        4,
        tokens=(1, 2, 3, 4, 5),
        max_tokens=9,
        sampling=Sampling(0.7, 40, 0.9, 0.05, 1.1, 1234),
        stop=("\n\n",),
        stop_ids=(2,),
        chunk_starts=(0, 3),
        namespace="tenant-a",
        cache=False,
        cache_key=(1, 2, 3, 4, 5),
        logits=True,
        images=(IMAGE,),
    ),
    Generate(5, messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "x"})),
    Cancel(6, target=4),
    Status(7),
    Tokenize(8, text="Hello world", add_special=False),
    Tokenize(9, messages=({"role": "user", "content": "Hi"},)),
    Detokenize(10, (1, 2, 3)),
]
EVENTS = [
    HelloReply(1, 1, "prefixd 0.1.0", {"name": "SmolLM2"}, {"max_frame_bytes": 8 << 20}),
    TokenEvent(3, (42, 43), "ab"),
    TokenEvent(3, (44,), "c", ("0" * 64,)),
    DoneEvent(3, "length", Usage(5, 2, 3, 9, 0.25, 1.5, "hit")),
    DoneEvent(4, "error", Usage(cache="off"), "engine failed"),
    OkReply(6),
    StatusReply(7, {"lanes_busy": 2, "model": {"name": "m"}}),
    TokensReply(8, (1, 2)),
    TokensReply(9, (1, 2, 3), (0, 2)),
    TextReply(10, "abc"),
    ErrorReply(11, "not_found", "no generate 99 in flight"),
    ErrorReply(None, "bad_frame", "garbage"),
]


def through_frame(msg: dict[str, Any]) -> dict[str, Any]:
    (out,) = FrameDecoder().feed(encode_frame(msg))
    return out


@pytest.mark.parametrize("request_msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_every_request_round_trips_through_a_frame(request_msg: Any) -> None:
    wire = through_frame(request_msg.to_wire())
    assert parse_request(wire) == request_msg
    assert type(request_msg).from_wire(wire) == request_msg


@pytest.mark.parametrize("event", EVENTS, ids=lambda m: type(m).__name__)
def test_every_event_round_trips_through_a_frame(event: Any) -> None:
    wire = through_frame(event.to_wire())
    assert parse_event(wire) == event
    assert type(event).from_wire(wire) == event


def test_generate_defaults() -> None:
    msg = parse_request({"type": "generate", "id": 1, "prompt": "x"})
    assert msg == Generate(1, prompt="x")
    assert (msg.max_tokens, msg.cache, msg.logits, msg.namespace, msg.chunk_starts) == (256, True, False, "", None)
    assert msg.sampling == Sampling(0.0, 0, 1.0, 0.0, 1.0, None)


def test_events_ignore_unknown_fields_requests_do_not() -> None:
    assert parse_event({"type": "ok", "id": 3, "later": 1}) == OkReply(3)
    error = request_error({"type": "status", "id": 3, "later": 1})
    assert (error.code, error.message, error.request_id) == (ErrorCode.BAD_REQUEST, "later: unknown field", 3)


def request_error(data: dict[str, Any]) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_request(data)
    return info.value


def gen(**fields: Any) -> dict[str, Any]:
    return {"type": "generate", "id": 5, "prompt": "x", **fields}


@pytest.mark.parametrize(
    ("data", "code", "message"),
    [
        ({"id": 1}, ErrorCode.BAD_REQUEST, "type: required string"),
        ({"type": "fly", "id": 1}, ErrorCode.UNKNOWN_TYPE, "type: unknown message type 'fly'"),
        ({"type": "status"}, ErrorCode.BAD_REQUEST, "id: required"),
        ({"type": "status", "id": "1"}, ErrorCode.BAD_REQUEST, "id: must be an integer, got string"),
        ({"type": "status", "id": True}, ErrorCode.BAD_REQUEST, "id: must be an integer, got bool"),
        ({"type": "status", "id": -1}, ErrorCode.BAD_REQUEST, "id: -1 outside [0, 9223372036854775807]"),
        (gen(max_tokens=0), ErrorCode.BAD_REQUEST, "max_tokens: 0 outside [1, 2147483647]"),
        (gen(max_tokens=-3), ErrorCode.BAD_REQUEST, "max_tokens: -3 outside [1, 2147483647]"),
        (gen(max_tokens=2.0), ErrorCode.BAD_REQUEST, "max_tokens: must be an integer, got float"),
        (gen(tokens=[1]), ErrorCode.BAD_REQUEST, "prompt: exactly one of prompt, tokens, messages is required, got 2"),
        ({"type": "generate", "id": 5}, ErrorCode.BAD_REQUEST, "prompt: exactly one of prompt, tokens, messages is required, got 0"),
        ({"type": "generate", "id": 5, "tokens": []}, ErrorCode.BAD_REQUEST, "tokens: must not be empty"),
        ({"type": "generate", "id": 5, "tokens": [1, "a"]}, ErrorCode.BAD_REQUEST, "tokens: must hold integers, got string"),
        ({"type": "generate", "id": 5, "tokens": [1, -2]}, ErrorCode.INVALID_TOKEN, "tokens: -2 outside [0, 2147483647]"),
        ({"type": "generate", "id": 5, "messages": [{"role": "user"}]}, ErrorCode.BAD_REQUEST, "messages[0].content: required"),
        ({"type": "generate", "id": 5, "messages": [{"role": 1, "content": ""}]}, ErrorCode.BAD_REQUEST, "messages[0].role: must be a string, got int"),
        ({"type": "generate", "id": 5, "messages": ["hi"]}, ErrorCode.BAD_REQUEST, "messages[0]: must be a map"),
        (gen(sampling={"temperature": -1}), ErrorCode.BAD_REQUEST, "sampling.temperature: -1 outside [0.0, inf]"),
        (gen(sampling={"top_p": 0}), ErrorCode.BAD_REQUEST, "sampling.top_p: must be above 0"),
        (gen(sampling={"temp": 1}), ErrorCode.BAD_REQUEST, "sampling.temp: unknown field"),
        (gen(sampling={"seed": "x"}), ErrorCode.BAD_REQUEST, "sampling.seed: must be an integer, got string"),
        (gen(sampling=[1]), ErrorCode.BAD_REQUEST, "sampling: must be a map, got array"),
        (gen(stop=["a", 1]), ErrorCode.BAD_REQUEST, "stop[1]: must be a string, got int"),
        (gen(stop=[""]), ErrorCode.BAD_REQUEST, "stop: stop strings must not be empty"),
        (gen(chunk_starts=[0, 4, 4]), ErrorCode.BAD_REQUEST, "chunk_starts: must be strictly increasing"),
        (gen(cache="yes"), ErrorCode.BAD_REQUEST, "cache: must be a boolean, got string"),
        (gen(namespace=3), ErrorCode.BAD_REQUEST, "namespace: must be a string, got int"),
        (gen(images=[{**IMAGE.to_wire(), "rows": b"\x00" * 12}]), ErrorCode.BAD_REQUEST, "images[0].rows: 12 bytes is not tokens x hidden float32 values"),
        (gen(images=[{**IMAGE.to_wire(), "hash": b""}]), ErrorCode.BAD_REQUEST, "images[0].hash: must hold 1 to 64 bytes"),
        (gen(images=[{**IMAGE.to_wire(), "gh": 0}]), ErrorCode.BAD_REQUEST, "images[0].gh: 0 outside [1, 9223372036854775807]"),
        (gen(images=[IMAGE.to_wire(), IMAGE.to_wire()]), ErrorCode.BAD_REQUEST, "images[1].at: images must be sorted and must not overlap"),
        ({"type": "cancel", "id": 1}, ErrorCode.BAD_REQUEST, "target: required"),
        ({"type": "hello", "id": 1, "versions": []}, ErrorCode.BAD_REQUEST, "versions: must not be empty"),
        ({"type": "tokenize", "id": 1}, ErrorCode.BAD_REQUEST, "text: exactly one of text, messages is required"),
        ({"type": "detokenize", "id": 1, "ids": [1 << 31]}, ErrorCode.INVALID_TOKEN, "ids: 2147483648 outside [0, 2147483647]"),
    ],
)
def test_validation_errors_name_the_field(data: dict[str, Any], code: ErrorCode, message: str) -> None:
    error = request_error(data)
    assert (error.code, error.message) == (code, message)
    assert not error.fatal


def test_errors_carry_the_request_id_when_it_is_valid() -> None:
    assert request_error(gen(max_tokens=0)).request_id == 5
    assert request_error({"type": "status", "id": "x"}).request_id is None
    assert request_error({"type": "nope", "id": 8}).to_wire() == {
        "type": "error", "id": 8, "code": "unknown_type", "message": "type: unknown message type 'nope'",
    }


def test_from_wire_of_the_wrong_class_is_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        Cancel.from_wire(Status(1).to_wire())
    assert info.value.message == "type: expected 'cancel'"


def test_image_hidden_size_comes_from_rows() -> None:
    assert IMAGE.hidden == 2  # 16 bytes / (2 tokens * 4 bytes)
    image = Image.from_wire({"at": 0, "tokens": 3, "gh": 1, "gw": 3, "hash": b"h", "rows": memoryview(bytes(3 * 8 * 4))})
    assert image.hidden == 8


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"type": "done", "id": 1, "finish_reason": "bored", "usage": Usage().to_wire()}, "finish_reason: 'bored' is not one of stop, length, cancelled, error, tool_calls"),
        ({"type": "done", "id": 1, "finish_reason": "stop", "usage": {**Usage().to_wire(), "cache": "maybe"}}, "usage.cache: 'maybe' is not one of miss, hit, shared, resident, off"),
        ({"type": "token", "id": 1, "ids": [1, 2], "text": "", "logits_sha256": ["0" * 64]}, "logits_sha256: 1 digests for 2 ids"),
        ({"type": "party", "id": 1}, "type: unknown event type 'party'"),
    ],
)
def test_bad_events_are_refused_with_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_event(data)
    assert info.value.message == message


def test_generate_draft_is_a_v2_field_off_or_auto() -> None:
    plain = parse_request({"type": "generate", "id": 1, "prompt": "x"})
    assert plain.draft is None and plain.min_version == 1 and "draft" not in plain.to_wire()
    msg = parse_request({"type": "generate", "id": 1, "prompt": "x", "draft": "off"})
    assert msg.draft == "off" and msg.to_wire()["draft"] == "off" and msg.min_version == 2
    with pytest.raises(ProtocolError, match="draft"):
        parse_request({"type": "generate", "id": 1, "prompt": "x", "draft": "mtp"})
