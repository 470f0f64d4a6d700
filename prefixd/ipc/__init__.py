"""Wire protocol (versions 1 and 2): framing, messages, memfd payloads, transport and the client library.

Imports nothing else from prefixd (and never torch); docs/protocol.md is the spec.
"""

from __future__ import annotations

from prefixd.ipc.client import AsyncClient, GenerateResult, GenerateStream, SyncClient
from prefixd.ipc.errors import ClientError, ErrorCode, ProtocolError
from prefixd.ipc.events import (
    DoneEvent,
    ErrorReply,
    HelloReply,
    OkReply,
    StatusReply,
    TextReply,
    TokenEvent,
    TokensReply,
    Usage,
)
from prefixd.ipc.framing import FrameDecoder, Limits, encode_frame
from prefixd.ipc.paths import default_socket_path
from prefixd.ipc.transport import FramedStream

__all__ = [
    "AsyncClient", "ClientError", "DoneEvent", "ErrorCode", "ErrorReply", "FrameDecoder", "FramedStream",
    "GenerateResult", "GenerateStream", "HelloReply", "Limits", "OkReply", "ProtocolError", "StatusReply",
    "SyncClient", "TextReply", "TokenEvent", "TokensReply", "Usage", "default_socket_path", "encode_frame",
]
