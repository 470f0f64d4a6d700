"""Large binary fields as sealed memfd segments passed with SCM_RIGHTS.

Sender: `extract_payloads` moves every binary field (and every int32 list) above the
threshold into a memfd, written once and sealed against shrink, grow, write and further
sealing, and leaves a `MemfdRef` in its place. Receiver: `resolve_payloads` checks each
referenced descriptor (size equals the declared size, seals include shrink, grow and
write), maps it read-only, and closes every descriptor of the frame, used or not.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
from array import array
from typing import Any, Iterator

from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.fields import request_id_of
from prefixd.ipc.framing import SCALAR_TYPES, Dtype, Frame, Limits, MemfdRef, close_fds

SEALS_REQUIRED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
SEALS_APPLIED = SEALS_REQUIRED | fcntl.F_SEAL_SEAL


def create_segment(data: Any, name: str = "prefixd-payload") -> int:
    """A new sealed memfd holding the bytes of `data`; the caller owns and closes the fd."""
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS_APPLIED)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _as_int32(values: list[Any]) -> array | None:
    """`values` as a little-endian int32 array, or None if they are not all int32."""
    if not all(type(v) is int for v in values):
        return None
    try:
        packed = array("i", values)
    except OverflowError:
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed


def extract_payloads(msg: dict[str, Any], limits: Limits) -> tuple[dict[str, Any], list[int]]:
    """A copy of `msg` with large fields moved to new memfds, and those fds in ref order.

    Bytes-likes over `limits.memfd_threshold_bytes` become BYTES segments (FLOAT32 when a
    memoryview of format "f"); int lists whose int32 size is over it become INT32 segments.
    Containers without large fields are shared, not copied. The caller closes the fds.
    """
    fds: list[int] = []

    def segment(data: Any, dtype: Dtype) -> MemfdRef:
        view = memoryview(data).cast("B")
        fds.append(create_segment(view))
        return MemfdRef(len(fds) - 1, view.nbytes, dtype)

    def walk(node: Any, depth: int) -> Any:
        if len(fds) >= limits.max_fds_per_frame or depth > limits.max_depth:
            return node
        kind = type(node)
        if kind in (bytes, bytearray, memoryview):
            view = memoryview(node)
            if view.nbytes <= limits.memfd_threshold_bytes:
                return node
            return segment(view, Dtype.FLOAT32 if view.format == "f" else Dtype.BYTES)
        if kind is dict:
            items = {k: walk(v, depth + 1) for k, v in node.items()}
            changed = any(items[k] is not v for k, v in node.items())
            return items if changed else node
        if kind is list:
            if len(node) * 4 > limits.memfd_threshold_bytes:
                packed = _as_int32(node)
                if packed is not None:
                    return segment(packed, Dtype.INT32)
            items_list = [walk(v, depth + 1) for v in node]
            changed = any(a is not b for a, b in zip(items_list, node))
            return items_list if changed else node
        return node

    try:
        out = walk(msg, 1)
    except BaseException:
        close_fds(fds)
        raise
    return out, fds


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_PAYLOAD, message)


def _check_ref(ref: MemfdRef, limits: Limits) -> None:
    """What a ref declares, checked without touching its descriptor."""
    if ref.num_bytes > limits.max_memfd_bytes:
        raise _bad(f"memfd of {ref.num_bytes} bytes exceeds {limits.max_memfd_bytes}")
    if ref.num_bytes % ref.dtype.itemsize:
        raise _bad(f"memfd of {ref.num_bytes} bytes is not a whole number of {ref.dtype.name}")
    if ref.dtype is Dtype.INT32 and ref.num_bytes // 4 > limits.max_array_len:
        raise _bad(f"memfd array of {ref.num_bytes // 4} ids exceeds max_array_len {limits.max_array_len}")


def iter_refs(root: dict[str, Any]) -> Iterator[tuple[Any, Any, MemfdRef]]:
    """(container, key, ref) for every MemfdRef in the tree, without reading any segment."""
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if type(node) is list and set(map(type, node)) <= SCALAR_TYPES:
            continue  # a plain array (token ids) holds no refs
        keys = list(node.keys()) if type(node) is dict else range(len(node))
        for key in keys:
            child = node[key]
            kind = type(child)
            if kind is dict or kind is list:
                stack.append(child)
            elif kind is MemfdRef:
                yield node, key, child


def check_refs(frame: Frame, limits: Limits) -> None:
    """Refuse a frame's refs on what they declare alone (index, size, element count, the
    frame's total), before any segment is read. Raises ProtocolError(bad_payload)."""
    if frame.num_refs == 0:
        return
    total = 0
    for _, _, ref in iter_refs(frame.msg):
        if ref.fd >= len(frame.fds):
            raise _bad(f"memfd ref to descriptor {ref.fd}, frame has {len(frame.fds)}")
        _check_ref(ref, limits)
        total += ref.num_bytes
    if total > limits.max_payload_bytes:
        raise _bad(f"memfd segments of {total} bytes in one frame exceed {limits.max_payload_bytes}")


def read_segment(fd: int, ref: MemfdRef, limits: Limits, *, arrays: bool = False) -> Any:
    """The checked content of one received segment: for INT32 a list[int], or with
    `arrays` an array.array("i") (no Python int object per id); else bytes.

    The segment is mapped read-only and copied out, so nothing keeps `fd` or a mapping
    alive afterwards (a live mmap holds its own duplicate of the descriptor). Does not
    close `fd`."""
    _check_ref(ref, limits)
    try:
        size = os.fstat(fd).st_size
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise _bad(f"descriptor is not a sealed memfd: {exc.strerror}") from None
    if size != ref.num_bytes:
        raise _bad(f"memfd holds {size} bytes, declared {ref.num_bytes}")
    if seals & SEALS_REQUIRED != SEALS_REQUIRED:
        raise _bad("memfd is not sealed against shrink, grow and write")
    if ref.dtype is Dtype.INT32 and arrays:
        return _read_int32(fd, size)
    if size == 0:
        return [] if ref.dtype is Dtype.INT32 else b""
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapped:
        if ref.dtype is not Dtype.INT32:
            return bytes(mapped)
        values = array("i")
        values.frombytes(mapped)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _read_int32(fd: int, num_bytes: int) -> array:
    out = array("i", bytes(num_bytes))
    view = memoryview(out).cast("B")
    done = 0
    while done < num_bytes:
        n = os.preadv(fd, [view[done:]], done)
        if n == 0:
            raise _bad(f"memfd ended after {done} of {num_bytes} bytes")
        done += n
    view.release()
    if sys.byteorder == "big":
        out.byteswap()
    return out


def resolve_payloads(frame: Frame, limits: Limits, *, arrays: bool = False) -> dict[str, Any]:
    """The frame's map with every MemfdRef replaced by its checked content (INT32 segments
    as array.array with `arrays`, see read_segment).

    Closes every descriptor of the frame, whether or not it is referenced, also on error.
    """
    try:
        check_refs(frame, limits)
        if frame.num_refs:
            for node, key, ref in list(iter_refs(frame.msg)):
                node[key] = read_segment(frame.fds[ref.fd], ref, limits, arrays=arrays)
        return frame.msg
    except ProtocolError as exc:
        raise exc.with_id(request_id_of(frame.msg)) from None
    finally:
        close_fds(frame.fds)
