"""The model's content hash: computed once per file version, cached in the cache directory."""

from __future__ import annotations

import hashlib
import json
import os

from prefixd.disk import identity
from prefixd.disk.identity import HASHES_FILE, model_content_hash


def test_the_hash_is_of_the_content_and_a_restart_reads_it_from_the_cache(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights" * 1000)
    cache = tmp_path / "cache"
    first = model_content_hash(model, cache)
    h = hashlib.blake2b(digest_size=16)
    h.update(b"m.gguf\0" + b"weights" * 1000)
    assert first == h.hexdigest()
    assert list(json.loads((cache / HASHES_FILE).read_text()).values()) == [first]
    calls = []
    monkeypatch.setattr(identity, "hash_files", lambda files: calls.append(files) or "rehashed")
    assert model_content_hash(model, cache) == first and calls == []  # unchanged: not read again
    model.write_bytes(b"other!" * 1000)
    os.utime(model, ns=(1, 1))
    assert model_content_hash(model, cache) == "rehashed" and len(calls) == 1


def test_a_model_directory_hashes_every_file_and_an_unwritable_cache_still_hashes(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\1\2\3")
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory should be")
    a = model_content_hash(d, blocked)
    (d / "config.json").write_text('{"x": 1}')
    assert model_content_hash(d, None) != a
