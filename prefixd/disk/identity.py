"""The model's content hash, computed once per file version and cached in the cache directory.

The hash (blake2b-128 over the bytes of the model file, or of every regular file of a model
directory in name order) is kept in DIR/model-hashes.json keyed by (path, size, mtime_ns), so a
restart of an unchanged model does not read it again. A file changed in place with its size
and mtime kept would escape this; the key is what `make` and package managers change.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger("prefixd.disk")
HASHES_FILE = "model-hashes.json"
_CHUNK = 1 << 20


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    return [path]


def _stamp(files: list[Path]) -> str:
    parts = []
    for f in files:
        st = f.stat()
        parts.append(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    return "\n".join(parts)


def hash_files(files: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def model_content_hash(path: Path, cache_dir: Path | None) -> str:
    """The content hash of the model at `path`, from the cache when its files are unchanged."""
    files = _files(Path(path))
    stamp = _stamp(files)
    cache = Path(cache_dir) / HASHES_FILE if cache_dir is not None else None
    known = _read(cache)
    if stamp in known:
        return known[stamp]
    digest = hash_files(files)
    if cache is not None:
        known[stamp] = digest
        _write(cache, known)
    return digest


def _read(cache: Path | None) -> dict[str, str]:
    if cache is None:
        return {}
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def _write(cache: Path, known: dict[str, str]) -> None:
    temp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        temp.write_text(json.dumps(known, indent=0, sort_keys=True))
        os.replace(temp, cache)
    except OSError as e:  # the hash is still right; the next start computes it again
        log.warning("cannot cache the model hash in %s: %s", cache.parent, e)
        with contextlib.suppress(OSError):  # nothing to clean up where nothing could be made
            temp.unlink(missing_ok=True)
