"""Stable error codes of the wire protocol and the exceptions that carry them."""

from __future__ import annotations

from enum import Enum
from typing import Any


class ErrorCode(str, Enum):
    """Error codes as they appear on the wire. The strings never change within a version."""

    BAD_FRAME = "bad_frame"  # the bytes are not a frame holding one msgpack map within limits
    FRAME_TOO_LARGE = "frame_too_large"  # the length prefix exceeds max_frame_bytes
    BAD_REQUEST = "bad_request"  # a field is missing, unknown, of the wrong type or out of range
    UNKNOWN_TYPE = "unknown_type"  # the message type is not one of this version's
    UNSUPPORTED_VERSION = "unsupported_version"  # hello offered no version the server speaks
    INVALID_TOKEN = "invalid_token"  # a token id outside the model's vocabulary
    CONTEXT_OVERFLOW = "context_overflow"  # prompt plus max_tokens exceed the model's context
    BAD_PAYLOAD = "bad_payload"  # a memfd segment of the wrong size, unsealed, or missing
    NOT_FOUND = "not_found"  # cancel of an id that is not in flight
    DUPLICATE_ID = "duplicate_id"  # a request id already in flight on this connection
    TOO_MANY_STREAMS = "too_many_streams"  # the connection or daemon holds too many streams
    SHUTTING_DOWN = "shutting_down"  # the daemon is stopping and takes no new work
    TOO_MANY_CONNECTIONS = "too_many_connections"  # the daemon holds its maximum of connections
    FRAME_TIMEOUT = "frame_timeout"  # a frame was not completed within the frame deadline
    BUSY = "busy"  # the daemon's buffers for incomplete frames stayed full until the deadline
    INTERNAL = "internal"  # a bug on the server side; the message says what broke


# Errors after which the byte stream can no longer be split into frames.
_FATAL_CODES = frozenset({
    ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE, ErrorCode.TOO_MANY_CONNECTIONS, ErrorCode.FRAME_TIMEOUT,
    ErrorCode.BUSY,
})


class ProtocolError(Exception):
    """Bad input from the peer. Becomes `{type: "error", id, code, message}` on the wire.

    `request_id` is the id of the request it answers when known, else None.
    `fatal` is True when the connection must be closed because framing is lost.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        request_id: int | None = None,
        fatal: bool | None = None,
    ) -> None:
        super().__init__(f"{ErrorCode(code).value}: {message}")
        self.code = ErrorCode(code)
        self.message = message
        self.request_id = request_id
        self.fatal = self.code in _FATAL_CODES if fatal is None else fatal

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled by its fields (a heavy build's error crosses from its worker process)."""
        return ProtocolError, (self.code, self.message, self.request_id, self.fatal)

    def with_id(self, request_id: int | None) -> ProtocolError:
        """The same error answering `request_id`."""
        return ProtocolError(self.code, self.message, request_id, self.fatal)

    def to_wire(self) -> dict[str, Any]:
        return {"type": "error", "id": self.request_id, "code": self.code.value, "message": self.message}


class ClientError(Exception):
    """An error reported to a client: a server `error` reply, or a local failure.

    `code` is an `ErrorCode` value for server errors, or "disconnected" when the
    connection ended before the reply arrived.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


DISCONNECTED = "disconnected"
