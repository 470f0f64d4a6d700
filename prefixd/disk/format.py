"""The entry file: a checked head, then the body (KV pages | lane state | logits row).

    offset 0    b"PXDC"                      magic
           4    u32 format version
           8    u32 H, the header's length
          12    16 bytes: the tier identity  (model hash, dtype, device, mode, layout, version)
          28    H bytes: msgpack header       (digest, parent, cut, pages, part lengths)
       28+H    16 bytes: blake2b of [0, 28+H)
       44+H    body: kv | state | logits     (lengths in the header)
        end    32 bytes: blake2b of the body

A start-up scan reads and checks the head only; a read that serves the entry checks the
body's sum. The file's size must be exactly what the head says (a torn write is short).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import BinaryIO, Sequence

import msgpack

from prefixd.disk.index import FORMAT_VERSION, TierIdentity

MAGIC = b"PXDC"
SUFFIX = ".pxc"
TEMP_SUFFIX = ".tmp"
_FIXED = struct.Struct("<4sII16s")  # magic, version, header length, identity
HEAD_SUM_BYTES = 16
BODY_SUM_BYTES = 32
MAX_HEADER_BYTES = 1 << 16


class BadFile(Exception):
    """A file that must not be served: torn, truncated, corrupt or foreign. The message says which."""


@dataclass(frozen=True, slots=True)
class FileMeta:
    digest: bytes
    parent: bytes | None
    cut: int
    first_page: int
    num_pages: int
    kv_bytes: int
    state_bytes: int
    logits_bytes: int

    @property
    def body_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes + self.logits_bytes


def encode_head(identity: bytes, meta: FileMeta) -> bytes:
    header = msgpack.packb({
        "digest": meta.digest, "parent": meta.parent, "cut": meta.cut, "first_page": meta.first_page,
        "num_pages": meta.num_pages, "kv": meta.kv_bytes, "state": meta.state_bytes, "logits": meta.logits_bytes,
    })
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, len(header), identity) + header
    return head + hashlib.blake2b(head, digest_size=HEAD_SUM_BYTES).digest()


def body_hasher() -> "hashlib._Hash":
    return hashlib.blake2b(digest_size=BODY_SUM_BYTES)


def file_bytes(head: bytes, meta: FileMeta) -> int:
    return len(head) + meta.body_bytes + BODY_SUM_BYTES


def read_head(f: BinaryIO, identity: bytes, size: int) -> tuple[FileMeta, int]:
    """The header of an open entry file and the body's offset; raises BadFile."""
    fixed = f.read(_FIXED.size)
    if len(fixed) < _FIXED.size:
        raise BadFile("truncated head")
    magic, version, hlen, ident = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise BadFile("not an entry file")
    if version != FORMAT_VERSION:
        raise BadFile(f"format version {version}, this build reads {FORMAT_VERSION}")
    if ident != identity:
        raise BadFile("another model, dtype, device, mode or layout")
    if hlen > MAX_HEADER_BYTES:
        raise BadFile("header too long")
    rest = f.read(hlen + HEAD_SUM_BYTES)
    if len(rest) < hlen + HEAD_SUM_BYTES:
        raise BadFile("truncated head")
    header, digest = rest[:hlen], rest[hlen:]
    if hashlib.blake2b(fixed + header, digest_size=HEAD_SUM_BYTES).digest() != digest:
        raise BadFile("head checksum mismatch")
    meta = _meta(header)
    offset = _FIXED.size + hlen + HEAD_SUM_BYTES
    if size != offset + meta.body_bytes + BODY_SUM_BYTES:
        raise BadFile(f"size {size}, the head says {offset + meta.body_bytes + BODY_SUM_BYTES}")
    return meta, offset


def _meta(header: bytes) -> FileMeta:
    try:
        h = msgpack.unpackb(header)
        meta = FileMeta(h["digest"], h["parent"], int(h["cut"]), int(h["first_page"]), int(h["num_pages"]),
                        int(h["kv"]), int(h["state"]), int(h["logits"]))
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
        raise BadFile(f"unreadable header: {e}") from None
    if not isinstance(meta.digest, bytes) or not (meta.parent is None or isinstance(meta.parent, bytes)):
        raise BadFile("unreadable header: digest")
    if min(meta.cut, meta.first_page, meta.kv_bytes, meta.state_bytes, meta.logits_bytes) < 0 \
            or meta.first_page > meta.num_pages:
        raise BadFile("header out of range")
    return meta


def check_layout(meta: FileMeta, identity: TierIdentity) -> None:
    """Raise BadFile when the header's part sizes disagree with the tier's layout."""
    if meta.kv_bytes != (meta.num_pages - meta.first_page) * identity.kv_bytes_per_page \
            or meta.state_bytes not in (0, identity.lane_state_bytes) \
            or meta.logits_bytes not in (0, identity.logits_row_bytes) \
            or meta.num_pages != -(-meta.cut // identity.page_size):
        raise BadFile("part sizes disagree with the layout")


def read_body(f: BinaryIO, meta: FileMeta, offset: int) -> bytearray:
    """The body (writable, so device code can view it without a copy); raises BadFile when
    its checksum disagrees."""
    f.seek(offset)
    body = bytearray(meta.body_bytes)
    view = memoryview(body)
    got = 0
    while got < len(body):
        n = f.readinto(view[got:])
        if not n:
            raise BadFile("truncated body")
        got += n
    digest = f.read(BODY_SUM_BYTES)
    if body_hasher_of(view) != digest:
        raise BadFile("body checksum mismatch")
    return body


def body_hasher_of(parts: memoryview | Sequence[memoryview]) -> bytes:
    h = body_hasher()
    for part in ([parts] if isinstance(parts, memoryview) else parts):
        h.update(part)
    return h.digest()
