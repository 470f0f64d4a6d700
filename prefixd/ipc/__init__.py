"""Wire protocol v1: framing, messages, memfd payloads, transport and the client library.

Imports nothing else from prefixd (and never torch); docs/protocol.md is the spec.
"""

from __future__ import annotations

from prefixd.ipc.client import AsyncClient, GenerateResult, GenerateStream, SyncClient
from prefixd.ipc.errors import ClientError, ErrorCode, ProtocolError
from prefixd.ipc.framing import FrameDecoder, Limits, encode_frame
from prefixd.ipc.paths import default_socket_path
from prefixd.ipc.transport import FramedStream

__all__ = [
    "AsyncClient", "ClientError", "ErrorCode", "FrameDecoder", "FramedStream", "GenerateResult",
    "GenerateStream", "Limits", "ProtocolError", "SyncClient", "default_socket_path", "encode_frame",
]
