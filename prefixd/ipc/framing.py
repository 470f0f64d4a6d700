"""Frames: a 4-byte big-endian length, then one msgpack map of at most that many bytes.

Every limit is enforced before the memory it guards is allocated: the length prefix is
checked as soon as its 4 bytes arrive, and msgpack checks each str/bin/array/map/ext header
against `Limits` before building the object. Nesting depth and value types are checked on
the decoded tree (whose size the frame limit already bounds; msgpack's own fixed stack
bounds the nesting it will decode).

A large binary field may travel outside the frame as a memfd (see memfd.py). Inside the
map such a field is a msgpack ext value, code `MEMFD_EXT`, 10 bytes:

    +---------+------------------------+---------+
    | u8 fd   | u64 byte size (big end) | u8 dtype|
    +---------+------------------------+---------+

`fd` indexes the list of descriptors that arrived with this frame.
"""

from __future__ import annotations

import os
import struct
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any, Iterable

import msgpack

from prefixd.ipc.errors import ErrorCode, ProtocolError

HEADER_BYTES = 4
MEMFD_EXT = 1
_REF_LAYOUT = struct.Struct(">BQB")


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits of one connection, the same on both ends. Defaults are protocol v1's."""

    max_frame_bytes: int = 8 << 20  # msgpack body of one frame, without the 4-byte prefix
    max_str_bytes: int = 1 << 20  # one UTF-8 string
    max_bin_bytes: int = 4 << 20  # one inline binary field
    max_array_len: int = 1 << 20  # elements of one array
    max_map_len: int = 256  # keys of one map
    max_depth: int = 8  # nesting of maps and arrays; the frame's map is depth 1
    max_fds_per_frame: int = 8  # memfd segments that may ride with one frame
    max_memfd_bytes: int = 64 << 20  # one memfd segment: a 4096-row image of hidden 4096, float32
    max_payload_bytes: int = 128 << 20  # all memfd segments of one frame together
    memfd_threshold_bytes: int = 64 << 10  # a sender moves binary fields above this to memfds

    def to_wire(self) -> dict[str, int]:
        return asdict(self)


class Dtype(IntEnum):
    """How the bytes of a memfd segment are read."""

    BYTES = 0  # raw bytes
    INT32 = 1  # little-endian int32 array (token ids)
    FLOAT32 = 2  # little-endian float32 array (embedding rows)

    @property
    def itemsize(self) -> int:
        return 1 if self is Dtype.BYTES else 4


@dataclass(frozen=True, slots=True)
class MemfdRef:
    """A field whose value is the content of memfd number `fd` of its frame."""

    fd: int
    num_bytes: int
    dtype: Dtype

    def to_ext(self) -> msgpack.ExtType:
        return msgpack.ExtType(MEMFD_EXT, _REF_LAYOUT.pack(self.fd, self.num_bytes, self.dtype))


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: its map, the descriptors that arrived with it, its memfd refs."""

    msg: dict[str, Any]
    fds: tuple[int, ...]
    num_refs: int


def _frame_error(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_FRAME, message)


def _ext_hook(code: int, data: bytes) -> MemfdRef:
    if code != MEMFD_EXT:
        raise _frame_error(f"unknown ext type {code}")
    if len(data) != _REF_LAYOUT.size:
        raise _frame_error(f"memfd ref of {len(data)} bytes, expected {_REF_LAYOUT.size}")
    fd, num_bytes, dtype = _REF_LAYOUT.unpack(data)
    if dtype not in Dtype._value2member_map_:
        raise _frame_error(f"memfd ref with unknown dtype {dtype}")
    return MemfdRef(fd, num_bytes, Dtype(dtype))


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, MemfdRef):
        return obj.to_ext()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def encode_frame(msg: dict[str, Any], limits: Limits | None = None) -> bytes:
    """Serialize `msg` into one frame. With `limits`, a body over max_frame_bytes raises
    ProtocolError(frame_too_large) instead of being sent."""
    body = msgpack.packb(msg, use_bin_type=True, default=_pack_default)
    if limits is not None and len(body) > limits.max_frame_bytes:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"frame of {len(body)} bytes exceeds {limits.max_frame_bytes}"
        )
    return len(body).to_bytes(HEADER_BYTES, "big") + body


SCALAR_TYPES = frozenset({str, bytes, int, float, bool, type(None)})
_LEAVES = SCALAR_TYPES | {MemfdRef}


def _check_tree(root: dict[str, Any], max_depth: int) -> int:
    """Check nesting depth, key and value types; return the number of memfd refs."""
    num_refs = 0
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise _frame_error(f"nesting deeper than {max_depth}")
        if type(node) is dict:
            if not all(type(k) is str for k in node):
                raise _frame_error("map keys must be strings")
            children: Iterable[Any] = node.values()
        else:
            children = node
        kinds = set(map(type, children))
        if kinds <= SCALAR_TYPES:
            continue  # the common case: a list of ints or a map of scalars
        if not kinds <= _LEAVES | {dict, list}:
            bad = sorted(k.__name__ for k in kinds - _LEAVES - {dict, list})
            raise _frame_error(f"unsupported value type {bad[0]}")
        for child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif kind is MemfdRef:
                num_refs += 1
    return num_refs


def decode_body(body: bytes | memoryview, limits: Limits) -> tuple[dict[str, Any], int]:
    """Decode one frame body into its map and its number of memfd refs."""
    try:
        msg = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_ext_hook,
            max_str_len=limits.max_str_bytes,
            max_bin_len=limits.max_bin_bytes,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=_REF_LAYOUT.size,
        )
    except ValueError as exc:  # every msgpack decode failure, UnicodeDecodeError included
        raise _frame_error(f"undecodable msgpack: {exc}") from None
    if type(msg) is not dict:
        raise _frame_error(f"a frame holds a map, got {type(msg).__name__}")
    return msg, _check_tree(msg, limits.max_depth)


def too_many_fds(num_fds: int, limits: Limits) -> ProtocolError:
    """The framing error for a frame that brought more descriptors than allowed."""
    return ProtocolError(
        ErrorCode.BAD_FRAME, f"{num_fds} descriptors for one frame exceed {limits.max_fds_per_frame}"
    )


def close_fds(fds: Iterable[int]) -> None:
    """Close descriptors this process received and owns."""
    for fd in fds:
        os.close(fd)


class FrameDecoder:
    """Splits a byte stream (and the descriptors riding on it) into frames.

    Descriptors received by one recvmsg belong to the frame holding the last byte that
    recvmsg returned: the kernel attaches them to the first byte a sender's sendmsg wrote
    and never returns bytes past them in the same call. After a ProtocolError the decoder
    has closed every descriptor it held and raises that error again on every feed.
    """

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._buf = bytearray()
        self._pending_fds: list[int] = []  # fds of the frame in progress
        self._error: ProtocolError | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes of a frame in progress; nonzero at end of stream means a truncated frame."""
        return len(self._buf)

    @property
    def frame_bytes_needed(self) -> int:
        """Bytes the frame in progress will hold once complete (prefix included), as far as
        its prefix tells; 0 between frames."""
        if len(self._buf) < HEADER_BYTES:
            return len(self._buf)
        return HEADER_BYTES + int.from_bytes(self._buf[:HEADER_BYTES], "big")

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Feed bytes without descriptors; return the maps of the frames they complete."""
        return [frame.msg for frame in self.feed_fds(data, ())]

    def feed_fds(self, data: bytes, fds: Iterable[int]) -> list[Frame]:
        """Feed bytes and the descriptors received with them; return completed frames.

        The caller owns the descriptors of returned frames; the decoder owns the rest.
        """
        new_fds = list(fds)
        if self._error is not None:
            close_fds(new_fds)
            raise self._error
        decoded: list[tuple[dict[str, Any], int]] = []
        try:
            self._buf += data
            decoded = self._split()
        except ProtocolError as exc:
            self._error = exc
            self._buf = bytearray()
            close_fds(new_fds)
            self.close()
            raise
        return self._attach_fds(decoded, new_fds)

    def _split(self) -> list[tuple[dict[str, Any], int]]:
        out: list[tuple[dict[str, Any], int]] = []
        buf, pos, end = self._buf, 0, len(self._buf)
        max_bytes = self.limits.max_frame_bytes
        while end - pos >= HEADER_BYTES:
            size = int.from_bytes(buf[pos : pos + HEADER_BYTES], "big")
            if size > max_bytes:
                raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"frame of {size} bytes exceeds {max_bytes}")
            if size == 0:
                raise _frame_error("empty frame")
            if end - pos - HEADER_BYTES < size:
                break
            with memoryview(buf) as view, view[pos + HEADER_BYTES : pos + HEADER_BYTES + size] as body:
                out.append(decode_body(body, self.limits))  # decoded values copy what they keep
            pos += HEADER_BYTES + size
        del buf[:pos]
        return out

    def _attach_fds(self, decoded: list[tuple[dict[str, Any], int]], new_fds: list[int]) -> list[Frame]:
        groups: list[list[int]] = [[] for _ in decoded]
        if decoded:
            groups[0], self._pending_fds = self._pending_fds, []
        if self._buf:
            self._pending_fds += new_fds  # the last byte belongs to the frame in progress
        elif decoded:
            groups[-1] += new_fds
        else:
            close_fds(new_fds)  # descriptors with no bytes belong to no frame
        most = max((len(group) for group in [*groups, self._pending_fds]), default=0)
        if most > self.limits.max_fds_per_frame:
            self._error = too_many_fds(most, self.limits)
            for group in groups:
                close_fds(group)
            self.close()
            raise self._error
        return [Frame(msg, tuple(group), refs) for (msg, refs), group in zip(decoded, groups)]

    def close(self) -> None:
        """Close the descriptors of the frame in progress."""
        pending, self._pending_fds = self._pending_fds, []
        close_fds(pending)
