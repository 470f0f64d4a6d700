"""The shared tier over a real Redis/Valkey server, with engines on the fake device: a daemon
with an empty disk resumes another's turn exactly; bad values are never served and are deleted;
a server that dies or stalls costs hits, never a request."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import signal
import time

import pytest

from prefixd.disk.format import encode_head, read_head
from prefixd.disk.shared import SharedConfig, SharedTier
from prefixd.scheduler.chunks import plan_schedule
from prefixd.scheduler.store import make_key
from tests.helpers.redis_server import redis_server  # noqa: F401 (a fixture)
from tests.scheduler.disk_rig import disk_engine
from tests.scheduler.engines import make_engine, req, turn

SYSTEM = list(range(10, 20))
FIRST = req(1, SYSTEM + [1, 2, 3], max_tokens=4)  # 13 rows: cuts 4, 8, 12, 13
LATER = req(2, SYSTEM + [1, 2, 3, 7, 8, 9], max_tokens=5)  # 16 rows: cuts 4, 8, 12, 16 (row 13 resumes too)


def cold(r, **info_kw):
    engine, _ = make_engine(num_lanes=1, grid=4, budget=16, cache=False, store=True, **info_kw)
    return turn(engine, r)[0]


def shared_engine(directory, url, *, query="", ident_kw=None, **info_kw):
    engine, device, tier = disk_engine(directory, ident_kw=ident_kw, **info_kw)
    tier.shared = SharedTier(SharedConfig.parse(url + query), tier.identity)
    return engine, device, tier


def publish_first(tmp_path, url, **info_kw):
    """Daemon A serves FIRST and sends its entries; returns its tier."""
    engine, _, a = shared_engine(tmp_path / "a", url, **info_kw)
    turn(engine, FIRST)
    assert a.flush(30)
    return a


def pxc_files(d):
    return sorted(p for p in os.listdir(d) if p.endswith(".pxc"))


def test_a_daemon_with_an_empty_disk_resumes_another_daemons_turn_from_the_shared_store(tmp_path, redis_server):
    a = publish_first(tmp_path, redis_server.url)
    assert a.stats().shared_published == a.stats().entries == len(redis_server.keys()) == 4
    engine, device, b = shared_engine(tmp_path / "b", redis_server.url)
    tokens, done = turn(engine, LATER)
    assert tokens == cold(LATER)
    assert (done.usage.cached_tokens, done.usage.cache) == (13, "shared")
    stats = b.stats()
    assert (stats.shared, stats.shared_hit_tokens, stats.shared_fetched, stats.hit_tokens) == ("up", 13, 1, 0)
    assert sum(len(p) for p in device.loaded) == 4  # pages 0..3, through the disk tier's load
    assert b.flush(30)
    # the fetched chain is now B's own files too; only B's new cut (16) is sent back
    assert set(pxc_files(tmp_path / "a")) < set(pxc_files(tmp_path / "b")) and len(pxc_files(tmp_path / "b")) == 5
    assert b.stats().shared_published == 1 and len(redis_server.keys()) == 5
    b.close()
    # a restart of B on its own directory, the shared tier off: the adopted files serve locally
    engine, _, b2 = disk_engine(tmp_path / "b")
    tokens, done = turn(engine, req(3, LATER.tokens, max_tokens=5))
    assert (done.usage.cached_tokens, done.usage.cache) == (16, "hit")  # from its own disk: not shared
    assert b2.stats().hit_tokens == 16 and b2.stats().corrupt == 0


def test_a_hybrid_state_from_the_shared_store_resumes_at_a_cut_of_the_requests_schedule(tmp_path, redis_server):
    kw = dict(invariant_rows=False)
    r1 = req(1, SYSTEM + [1, 2], max_tokens=2, chunk_starts=(10,))
    engine, _, a = shared_engine(tmp_path / "a", redis_server.url, **kw)
    turn(engine, r1)
    assert a.flush(30)
    r2 = req(2, SYSTEM + [1, 2, 3, 4, 5], max_tokens=3, chunk_starts=(10, 12))
    engine, _, b = shared_engine(tmp_path / "b", redis_server.url, **kw)
    tokens, done = turn(engine, r2)
    assert (done.usage.cached_tokens, done.usage.cache) == (12, "shared") and b.stats().shared_hit_tokens == 12
    assert tokens == cold(r2, **kw)


def test_another_mode_never_fetches_an_entry(tmp_path, redis_server):
    publish_first(tmp_path, redis_server.url)
    engine, _, b = shared_engine(tmp_path / "b", redis_server.url, ident_kw={"mode": "fast"})
    tokens, done = turn(engine, LATER)
    assert done.usage.cached_tokens == 0 and tokens == cold(LATER)
    assert (b.stats().shared_fetched, b.stats().shared_dropped) == (0, 0)  # another key: never even read


def _flip_body_byte(value: bytes) -> bytes:
    at = len(value) - 40  # inside the body, before its sum
    return value[:at] + bytes([value[at] ^ 1]) + value[at + 1:]


def _other_identity(value: bytes) -> bytes:
    return value[:12] + bytes(16) + value[28:]  # the head's identity field (format.py)


@pytest.mark.parametrize("spoil", [_flip_body_byte, lambda v: v[:-7], _other_identity],
                         ids=["flipped-byte", "truncated", "foreign-identity"])
def test_a_bad_value_is_never_served_and_is_deleted(tmp_path, redis_server, spoil):
    a = publish_first(tmp_path, redis_server.url)
    root = next(e for e in a.index.entries.values() if e.parent is None)  # every chain starts here
    key = a.shared.key_of(root.digest)
    good = redis_server.client.get(key)
    redis_server.client.set(key, spoil(good))
    engine, _, b = shared_engine(tmp_path / "b", redis_server.url)
    tokens, done = turn(engine, LATER)
    assert done.usage.cached_tokens == 0 and tokens == cold(LATER)
    assert (b.stats().shared_dropped, b.stats().shared_fetched, b.stats().shared_hit_tokens) == (1, 0, 0)
    assert b.flush(30)
    # B's cold run kept the same cut: it sent the same bytes A had, in place of the bad ones
    assert redis_server.client.get(key) == good


def test_a_dead_store_costs_hits_and_one_warning_never_a_request(tmp_path, redis_server, caplog):
    engine_a, _, a = shared_engine(tmp_path / "a", redis_server.url)
    turn(engine_a, FIRST)
    assert a.flush(30)
    redis_server.stop()
    engine_b, _, b = shared_engine(tmp_path / "b", redis_server.url)
    with caplog.at_level(logging.WARNING, logger="prefixd.disk"):
        for i, r in enumerate([LATER, req(3, [4] * 15, max_tokens=3)]):
            tokens, done = turn(engine_b, r)
            assert done.usage.cached_tokens == 0 and tokens == cold(r)
        tokens, done = turn(engine_a, req(4, LATER.tokens, max_tokens=5))  # A still hits in RAM
        assert (done.usage.cached_tokens, done.usage.cache) == (13, "hit") and tokens == cold(LATER)
        b.flush(30)
    assert b.stats().shared.startswith("down: ") and b.stats().shared_errors == 1
    assert b.stats().shared_skipped > 0 and b.stats().entries > 0  # B still caches on its own disk
    assert a.stats().shared.startswith("down: ") and a.stats().shared_errors == 1
    assert sum("shared cache down" in r.message for r in caplog.records) == 2  # one each, for both requests


def test_a_stalled_store_is_waited_for_once_then_skipped_until_it_answers(tmp_path, redis_server):
    publish_first(tmp_path, redis_server.url)
    engine, _, b = shared_engine(tmp_path / "b", redis_server.url, query="?wait=0.2")
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        tokens, done = turn(engine, LATER)
        assert done.usage.cached_tokens == 0 and tokens == cold(LATER)
        assert b.stats().shared.startswith("busy: ") and b.stats().shared_errors == 1
        r = req(3, [4] * 15, max_tokens=3)  # not waited for: the first fetch is still out
        tokens, done = turn(engine, r)
        assert tokens == cold(r) and b.stats().shared_errors == 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30  # the stalled fetch ends once the server runs again
    while b.stats().shared != "up" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b.stats().shared == "up"


def test_the_url_takes_the_tiers_own_parameters_and_passes_the_rest_on():
    cfg = SharedConfig.parse("unix:///run/valkey.sock?db=2&ttl=3600&wait=0.5")
    assert (cfg.url, cfg.ttl_s, cfg.wait_s) == ("unix:///run/valkey.sock?db=2", 3600.0, 0.5)
    assert SharedConfig.parse("redis://10.0.0.5:6379/1").url == "redis://10.0.0.5:6379/1"
    for bad in ("http://x", "redis://h:1/0?ttl=0", "redis://h:1/0?wait=soon"):
        with pytest.raises(ValueError, match="--shared-cache"):
            SharedConfig.parse(bad)


def test_a_file_naming_a_parent_that_holds_other_rows_is_never_served(tmp_path, redis_server):
    """A head with good sums that names another prefix's file as its parent: the chain would
    hand out that prefix's rows, so the file naming it is deleted from the server; the lookup
    answers the deepest good chain (cut 4, below the forged file), and a request resuming there
    equals a cold run."""
    engine, _, a = shared_engine(tmp_path / "a", redis_server.url)
    turn(engine, FIRST)
    assert a.flush(30)
    mine = {e.cut: e for e in a.index.entries.values()}
    turn(engine, req(5, [7] * 13, max_tokens=2))
    assert a.flush(30)
    other_root = next(e for e in a.index.entries.values() if e.parent is None and e is not mine[4])
    key = a.shared.key_of(mine[8].digest)
    value = redis_server.client.get(key)
    meta, offset = read_head(io.BytesIO(value), a.identity.digest(), len(value))
    forged = encode_head(a.identity.digest(), dataclasses.replace(meta, parent=other_root.digest)) + value[offset:]
    redis_server.client.set(key, forged)

    lookup = SharedTier(SharedConfig.parse(redis_server.url), a.identity)  # B's, before any keep of its own
    reuse_key, _ = make_key(LATER.tokens, cache_key=None, namespace="", images=[], lookahead=0)
    chain = lookup.fetch(reuse_key, plan_schedule(len(LATER.tokens), (), 4), 0)
    assert [f.meta.digest for f in chain] == [mine[4].digest] and lookup.dropped == 1
    assert redis_server.client.get(key) is None and redis_server.client.get(a.shared.key_of(other_root.digest))
    lookup.close(30)
    redis_server.client.set(key, forged)

    engine, _, b = shared_engine(tmp_path / "b", redis_server.url)
    tokens, done = turn(engine, LATER)
    assert done.usage.cached_tokens == 4 and tokens == cold(LATER)
    assert (b.stats().shared_dropped, b.stats().shared_hit_tokens) == (1, 4)
