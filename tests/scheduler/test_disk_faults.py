"""Disk tier fault injection: a writer killed mid-write, a truncated file, a flipped byte, a
foreign format version, a full or read-only directory. Each file is never served, is counted
and removed, and the engine keeps serving (from RAM, or cold)."""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

from prefixd.disk.writer import DiskWriter
from tests.scheduler.disk_rig import disk_engine
from tests.scheduler.engines import make_engine, req, turn

SYSTEM = list(range(10, 20))
ROOT = Path(__file__).resolve().parents[2]


def cold(r):
    engine, _ = make_engine(num_lanes=1, grid=4, budget=16, cache=False, store=True)
    return turn(engine, r)[0]


def files(d: Path) -> list[Path]:
    return sorted(d.glob("*.pxc"), key=lambda p: p.stat().st_mtime_ns)


def warm_dir(d: Path) -> list[Path]:
    engine, _, tier = disk_engine(d)
    turn(engine, req(1, SYSTEM + [1, 2], max_tokens=2))  # cuts 4, 8, 12: a chain of three files
    tier.close()
    by_cut = sorted(tier.index.entries.values(), key=lambda e: e.cut)
    assert [e.cut for e in by_cut] == [4, 8, 12]
    return [d / f"{e.name}.pxc" for e in by_cut]


def restart_and_serve(d: Path):
    """A new engine on `d`: its tier's stats at start, and one request's tokens and usage."""
    engine, _, tier = disk_engine(d)
    at_start = tier.stats()
    r = req(2, SYSTEM + [1, 2, 3], max_tokens=3)
    tokens, done = turn(engine, r)
    assert tokens == cold(r)
    return at_start, done.usage, tier


def test_a_truncated_last_file_is_removed_and_counted_and_its_parent_still_serves(tmp_path):
    chain = warm_dir(tmp_path)
    last = chain[-1]
    last.write_bytes(last.read_bytes()[:-7])
    stats, usage, _ = restart_and_serve(tmp_path)
    assert (stats.corrupt, stats.entries) == (1, 2)
    assert not last.exists()
    assert usage.cached_tokens == 8  # the parent's cut


def test_a_flipped_body_byte_is_caught_on_read_and_the_entries_chaining_on_it_leave(tmp_path):
    chain = warm_dir(tmp_path)
    middle = chain[1]
    data = bytearray(middle.read_bytes())
    data[-40] ^= 0x01  # inside the body: the head still checks, the body sum does not
    middle.write_bytes(bytes(data))
    engine, _, tier = disk_engine(tmp_path)
    assert (tier.stats().corrupt, tier.stats().entries) == (0, 3)  # a start-up scan reads heads only
    r = req(2, SYSTEM + [1, 2, 3], max_tokens=3)
    tokens, done = turn(engine, r)
    assert tokens == cold(r) and done.usage.cached_tokens == 0
    assert tier.stats().corrupt == 1
    tier.flush()
    # removed with the file chaining on it; the cold run then wrote a good one under its name
    assert middle.read_bytes() != bytes(data) and chain[0].exists()
    tier.close()
    engine2, _, tier2 = disk_engine(tmp_path)
    assert turn(engine2, req(3, SYSTEM + [1, 2, 3], max_tokens=3))[1].usage.cached_tokens == 13
    assert tier2.stats().corrupt == 0


def test_a_file_of_another_format_version_is_foreign(tmp_path):
    chain = warm_dir(tmp_path)
    for f in chain:
        data = bytearray(f.read_bytes())
        data[4:8] = struct.pack("<I", 99)
        f.write_bytes(bytes(data))
    stats, usage, _ = restart_and_serve(tmp_path)
    assert (stats.corrupt, stats.entries, usage.cached_tokens) == (3, 0, 0)
    assert not any(f.exists() for f in chain)


def test_a_writer_killed_mid_write_leaves_a_temp_file_that_is_never_served(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from prefixd.disk.writer import DiskWriter, WriteJob
        def write(fd, data):
            if os.fstat(fd).st_size > 100:
                os.kill(os.getpid(), 9)  # the process dies between two writes of one file
            return os.write(fd, data[:64])
        w = DiskWriter(Path({str(tmp_path)!r}), write=write)
        w.submit_write(WriteJob(b"\\x01" * 16, None, b"head", (memoryview(b"x" * 4096),), 4132))
        w.flush(30)
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == -9
    temps = list(tmp_path.glob("*.tmp"))
    assert len(temps) == 1 and not files(tmp_path)
    stats, usage, _ = restart_and_serve(tmp_path)
    assert (stats.corrupt, stats.entries, usage.cached_tokens) == (1, 0, 0)
    assert not temps[0].exists()  # removed at start-up (the new tier's own writes may be under way)


def test_a_full_disk_turns_the_tier_off_once_and_serving_goes_on(tmp_path, caplog):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    engine, _, tier = disk_engine(tmp_path, writer=DiskWriter(tmp_path, write=full))
    r = req(1, SYSTEM + [1, 2], max_tokens=2)
    tokens, _ = turn(engine, r)
    tier.flush()
    tokens2, done = turn(engine, req(2, SYSTEM + [1, 2, 3, 4, 5], max_tokens=2))  # served from RAM
    assert tokens == cold(r) and done.usage.cached_tokens > 0
    assert tier.stats().off is not None and tier.stats().entries == 0
    assert [p.name for p in tmp_path.iterdir()] == ["lock"]  # no temp file left behind
    assert sum("disk cache off" in m for m in caplog.messages) == 1


def test_a_read_only_directory_turns_the_tier_off_and_serving_goes_on(tmp_path, caplog):
    def read_only(fd, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    engine, _, tier = disk_engine(tmp_path, writer=DiskWriter(tmp_path, write=read_only))
    r = req(1, SYSTEM, max_tokens=2)
    assert turn(engine, r)[0] == cold(r)
    tier.flush()
    assert turn(engine, req(2, SYSTEM, max_tokens=2))[0] == cold(r)
    assert "Read-only" in (tier.stats().off or "")
    assert sum("disk cache off" in m for m in caplog.messages) == 1


def test_a_full_writer_queue_skips_the_write_and_counts_it(tmp_path):
    engine, _, tier = disk_engine(tmp_path, writer=DiskWriter(tmp_path, max_pending_bytes=0))
    r = req(1, SYSTEM, max_tokens=1)
    assert turn(engine, r)[0] == cold(r)
    assert tier.stats().skipped == 3 and tier.stats().entries == 0


def test_files_chaining_on_a_missing_file_are_removed_at_start_up(tmp_path):
    chain = warm_dir(tmp_path)
    chain[1].unlink()
    engine, _, tier = disk_engine(tmp_path)
    assert (tier.stats().entries, tier.stats().corrupt) == (1, 0)  # the root stays; the orphan goes, uncounted
    assert chain[0].exists() and not chain[2].exists()
    r = req(2, SYSTEM + [1, 2, 3], max_tokens=3)
    tokens, done = turn(engine, r)
    assert tokens == cold(r) and done.usage.cached_tokens == 4


def test_a_second_tier_on_a_directory_in_use_refuses_it(tmp_path):
    import pytest as _pytest

    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from tests.scheduler.disk_rig import make_tier
        from tests.scheduler.fake_device import make_info
        make_tier(Path({str(tmp_path)!r}), make_info())
        print("held", flush=True)
        sys.stdin.read()
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with _pytest.raises(OSError, match="another process uses"):
            disk_engine(tmp_path)
    finally:
        holder.communicate("")
