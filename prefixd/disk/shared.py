"""`SharedTier`: the disk tier's entry files on a Redis or Valkey server, for other daemons.

    engine thread                             publisher thread          fetcher thread
    -------------                             ----------------          --------------
    publish(digest, cut, path, chain) ── queue (≤ 256) ──▶ read the file, SET EX ttl,
                                                           EXPIRE its ancestors, ZADD its cut
    fetch(key, schedule, above) ── job ──────────────────────────────▶ EXISTS the key's cuts,
          waits ≤ wait_s ◀── a verified chain, or None ───────────────  GETEX the deepest chain,
                                                                        check every file

A value is an entry file's bytes exactly as the disk tier writes it (format.py: head with the
tier identity and its own sum, body with its sum), under

    prefixd:v{FORMAT_VERSION}:{tier identity digest, hex}:{entry digest, hex}

so a key names everything that decides the rows' bits (model content hash, dtype, device,
mode and revision, layout: the tier identity; namespace, ids, images, cut and schedule hash:
the entry digest). A fetched file is served only when its head and body sums hold, its head
names this tier's identity and the digest asked for, and every file of its chain is the digest
of the request's own rows at its cut; a value that fails is deleted from the server (only if
it still holds the same bytes) and never served.

The server being down or slow costs hits, never a request: the engine thread waits at most
`wait_s` for an answer; an error or a socket timeout marks the tier down (one warning) and it
is not asked again until a PING answers (every RETRY_S); a fetch past its wait leaves the
tier `busy` (fetches do not wait) until that fetch ends. Keys expire `ttl_s` after they were
last published or fetched. Torch-free; redis is imported only here.
"""

from __future__ import annotations

import hashlib
import io
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit

from prefixd.disk.format import BadFile, FileMeta, check_layout, read_body, read_head
from prefixd.disk.index import FORMAT_VERSION, KeyDigests, TierIdentity, cut_hashes
from prefixd.scheduler.chunks import Schedule
from prefixd.scheduler.store import ReuseKey

log = logging.getLogger("prefixd.disk")

DEFAULT_TTL_S = 24 * 3600.0
DEFAULT_WAIT_S = 1.0
RETRY_S = 5.0
SOCKET_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 1.0
MAX_PENDING_PUBLISHES = 256
MAX_CANDIDATES = 1024  # cuts asked for per fetch, deepest first
MAX_VALUE_BYTES = (512 << 20) - 1  # a Redis string's limit (proto-max-bulk-len)
UP, BUSY, DOWN = "up", "busy", "down"
# delete a bad value only if the server still holds the bytes that failed (another daemon may
# have written a good copy since)
_DELETE_IF_SAME = "if redis.sha1hex(redis.call('GET', KEYS[1]) or '') == ARGV[1] then " \
                  "return redis.call('DEL', KEYS[1]) end return 0"


@dataclass(frozen=True, slots=True)
class SharedConfig:
    url: str  # redis://, rediss:// or unix:// as redis-py reads it, without our parameters
    ttl_s: float = DEFAULT_TTL_S
    wait_s: float = DEFAULT_WAIT_S

    @classmethod
    def parse(cls, text: str) -> "SharedConfig":
        """`redis://HOST:PORT/DB`, `rediss://...` or `unix:///PATH?db=N`, with optional `ttl=`
        and `wait=` (seconds). Raises ValueError saying what was expected."""
        parts = urlsplit(text)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"--shared-cache {text!r}: expected redis://HOST:PORT/DB or unix:///PATH")
        params, ours = [], {}
        for name, value in parse_qsl(parts.query):
            if name in ("ttl", "wait"):
                ours[name] = value
            else:
                params.append((name, value))  # redis-py's own (db, password, ...)
        try:
            ttl_s, wait_s = float(ours.get("ttl", DEFAULT_TTL_S)), float(ours.get("wait", DEFAULT_WAIT_S))
        except ValueError:
            raise ValueError(f"--shared-cache {text!r}: ttl and wait are seconds") from None
        if not (ttl_s >= 1 and wait_s > 0):
            raise ValueError(f"--shared-cache {text!r}: ttl must be at least 1 s and wait above 0")
        base = text.split("?", 1)[0]  # urlunsplit would drop the empty host of unix:///PATH
        return cls(base + (f"?{urlencode(params)}" if params else ""), ttl_s, wait_s)


@dataclass(frozen=True, slots=True)
class Fetched:
    """One verified file of a chain: its header, its head's bytes and its body."""

    meta: FileMeta
    head: bytes
    body: bytearray


@dataclass(eq=False)
class _FetchJob:
    key: ReuseKey
    schedule: Schedule
    above: int
    done: threading.Event
    chain: list[Fetched] | None = None
    waited_out: bool = False  # the engine stopped waiting; the tier stays busy until it ends


class SharedTier:
    """The shared store as the disk tier uses it; `client` is a redis.Redis (None: one for
    `config.url`). Counts are running totals; `state` is UP, BUSY or DOWN (`why` says why)."""

    def __init__(self, config: SharedConfig, identity: TierIdentity, client: Any = None) -> None:
        self.config = config
        self.identity = identity
        self._ident = identity.digest()
        self._prefix = f"prefixd:v{FORMAT_VERSION}:{self._ident.hex()}:"
        self._cuts_key = self._prefix + "cuts"  # every cut published (a row-invariant family resumes at any)
        self._r = client if client is not None else _connect(config.url)
        self._lock = threading.Lock()
        self.state, self.why = UP, ""
        self._probe_at = 0.0
        self.published = self.fetched = self.hit_tokens = self.dropped = self.errors = self.skipped = 0
        self._publishes: queue.Queue = queue.Queue()
        self._fetches: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._run_publisher, name="prefixd-shared-publish", daemon=True),
                         threading.Thread(target=self._run_fetcher, name="prefixd-shared-fetch", daemon=True)]
        for t in self._threads:
            t.start()

    def key_of(self, digest: bytes) -> str:
        return self._prefix + digest.hex()

    # -- engine thread ------------------------------------------------------------------
    def publish(self, digest: bytes, cut: int, path: Path, ancestors: Sequence[bytes]) -> None:
        """Queue the written file at `path` for the server, and a new expiry for its ancestors
        (a chain is served whole). Dropped and counted while the tier is down or the queue is full."""
        if self.state == DOWN or self._publishes.qsize() >= MAX_PENDING_PUBLISHES:
            self._skip()
            return
        self._publishes.put((digest, cut, Path(path), tuple(ancestors)))

    def fetch(self, key: ReuseKey, schedule: Schedule, above: int) -> list[Fetched] | None:
        """The verified chain (root first) of the deepest entry on the server deeper than
        `above` that the request may resume from (a cut of its schedule; for a row-invariant
        family also any cut published); None on a miss, a bad value, or when no answer comes
        within `wait_s` (at once when the tier is not up)."""
        if self.state != UP:
            return None
        job = _FetchJob(key, schedule, above, threading.Event())
        self._fetches.put(job)
        if not job.done.wait(self.config.wait_s):
            with self._lock:  # the fetcher sets `done` under it: either it answered or it sees `waited_out`
                if not job.done.is_set():
                    job.waited_out = True
                    if self.state == UP:
                        self.state, self.why = BUSY, f"no answer in {self.config.wait_s:g} s"
                        self.errors += 1
                        log.warning("shared cache slow (%s): serving from local caches until it answers",
                                    self.why)
                    return None
        if job.chain is not None:
            self.fetched += 1
        return job.chain

    def stats(self) -> dict[str, Any]:
        return {"state": self.state if self.state == UP else f"{self.state}: {self.why}",
                "hit_tokens": self.hit_tokens, "fetched": self.fetched, "published": self.published,
                "dropped": self.dropped, "errors": self.errors, "skipped": self.skipped}

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every publish queued so far is sent (or dropped); False on timeout."""
        done = threading.Event()
        self._publishes.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is queued (within `timeout_s`), then end both threads."""
        self._publishes.put(None)
        self._fetches.put(None)
        for t in self._threads:
            t.join(timeout_s)

    # -- state --------------------------------------------------------------------------
    def _skip(self) -> None:
        with self._lock:  # both the engine and the publisher thread count skips
            self.skipped += 1

    def _failed(self, e: Exception) -> None:
        """The server failed (or, not a client error, a bug: logged with its trace): down."""
        if not isinstance(e, OSError) and type(e).__module__.split(".")[0] != "redis":
            log.error("shared cache: unexpected error", exc_info=e)
        with self._lock:
            self.errors += 1
            if self.state == DOWN:
                return
            self.state, self.why = DOWN, f"{type(e).__name__}: {e}"
            self._probe_at = time.monotonic() + RETRY_S
        log.warning("shared cache down (%s): serving from local caches, retrying every %g s", self.why, RETRY_S)

    def _probe(self) -> None:
        """While down, PING every RETRY_S; an answer brings the tier back."""
        if self.state != DOWN or time.monotonic() < self._probe_at:
            return
        self._probe_at = time.monotonic() + RETRY_S
        try:
            self._r.ping()
        except Exception as e:  # any client error means still down; the next probe tries again
            log.debug("shared cache still down: %s", e)
            return
        with self._lock:
            self.state, self.why = UP, ""
        log.info("shared cache back: fetching and publishing again")

    # -- publisher thread ---------------------------------------------------------------
    def _run_publisher(self) -> None:
        while True:
            job = self._publishes.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            if self.state == DOWN:
                self._skip()
                continue
            try:
                self._send(*job)
            except Exception as e:  # a client error or a bug: the tier goes down, never the engine
                self._failed(e)

    def _send(self, digest: bytes, cut: int, path: Path, ancestors: tuple[bytes, ...]) -> None:
        try:
            value = path.read_bytes()
        except OSError:
            return  # evicted from the disk before it could be sent: nothing to share
        if len(value) > MAX_VALUE_BYTES:
            self._skip()
            return
        ttl = int(self.config.ttl_s)
        pipe = self._r.pipeline(transaction=False)
        pipe.set(self.key_of(digest), value, ex=ttl)
        for a in ancestors:
            pipe.expire(self.key_of(a), ttl)
        pipe.zadd(self._cuts_key, {str(cut): cut})
        pipe.expire(self._cuts_key, ttl)
        pipe.execute()
        self.published += 1

    # -- fetcher thread -----------------------------------------------------------------
    def _run_fetcher(self) -> None:
        while True:
            try:
                job = self._fetches.get(timeout=RETRY_S)
            except queue.Empty:
                self._probe()
                continue
            if job is None:
                return
            try:
                if self.state != DOWN:
                    job.chain = self._find(job.key, job.schedule, job.above)
            except Exception as e:  # a client error or a bug: the tier goes down, never the engine
                self._failed(e)
            finally:
                with self._lock:
                    job.done.set()
                    if job.waited_out and self.state == BUSY:
                        self.state, self.why = UP, ""
            self._probe()

    def _find(self, key: ReuseKey, schedule: Schedule, above: int) -> list[Fetched] | None:
        n = len(key.tokens)
        rows = {c for c in schedule.cuts if above < c <= n}
        if self.identity.invariant_rows and above < n:
            rows.update(int(c) for c in self._r.zrangebyscore(self._cuts_key, above + 1, n))
        digests, hashes = KeyDigests(key), cut_hashes(key, schedule, self.identity.invariant_rows)
        cuts = [(c, digests.at(c, hashes(c))) for c in sorted(rows)[-MAX_CANDIDATES:] if key.has_rows(c)]
        if not cuts:
            return None
        pipe = self._r.pipeline(transaction=False)
        for _, d in cuts:
            pipe.exists(self.key_of(d))
        present = pipe.execute()
        for (cut, digest), there in reversed(list(zip(cuts, present))):
            if there:
                chain = self._chain(key, schedule, digest, need_logits=cut == n)
                if chain is not None:
                    return chain
        return None

    def _chain(self, key: ReuseKey, schedule: Schedule, digest: bytes, *, need_logits: bool) -> list[Fetched] | None:
        """The chain ending at `digest`, root first, every file checked; None when a file is
        missing (expired or evicted on the server) or bad (deleted there)."""
        raw: list[tuple[bytes, bytes, FileMeta]] = []  # deepest first
        at: bytes | None = digest
        while at is not None:
            value = self._r.getex(self.key_of(at), ex=int(self.config.ttl_s))
            if value is None:
                return None
            try:
                meta, _ = read_head(io.BytesIO(value), self._ident, len(value))
            except BadFile as e:
                return self._drop(at, value, str(e))
            if meta.digest != at:
                return self._drop(at, value, "named for another entry")
            if raw and meta.cut >= raw[-1][2].cut:
                return self._drop(*raw[-1][:2], "its parent is not shallower")
            raw.append((at, value, meta))
            at = meta.parent
        return self._verify(key, schedule, raw[::-1], need_logits)

    def _verify(self, key: ReuseKey, schedule: Schedule, raw: list[tuple[bytes, bytes, FileMeta]],
                need_logits: bool) -> list[Fetched] | None:
        """Check each file of a chain (root first): its layout, where its pages start, that
        its digest is the request's own at its cut, and its body's sum."""
        digests, hashes = KeyDigests(key), cut_hashes(key, schedule, self.identity.invariant_rows)
        P = self.identity.page_size
        out: list[Fetched] = []
        for i, (digest, value, meta) in enumerate(raw):
            if not key.has_rows(meta.cut) or digests.at(meta.cut, hashes(meta.cut)) != digest:
                # only an ancestor can fail this (the deepest was asked for by the request's
                # digest): the file naming it as its parent is wrong
                return self._drop(*raw[i + 1][:2], "its parent holds other rows than the request's")
            f = io.BytesIO(value)
            try:
                _, offset = read_head(f, self._ident, len(value))
                check_layout(meta, self.identity)
                if meta.first_page != (out[-1].meta.cut // P if out else 0):
                    raise BadFile("its pages do not start where its parent's end")
                body = read_body(f, meta, offset)
            except BadFile as e:
                return self._drop(digest, value, str(e))
            out.append(Fetched(meta, value[:offset], body))
        if need_logits and not out[-1].meta.logits_bytes:
            return None
        return out

    def _drop(self, digest: bytes, value: bytes, why: str) -> None:
        self.dropped += 1
        log.warning("shared cache: %s not served (deleted): %s", digest.hex()[:12], why)
        self._r.eval(_DELETE_IF_SAME, 1, self.key_of(digest), hashlib.sha1(value).hexdigest())
        return None


def _connect(url: str) -> Any:
    """A redis-py client for `url` with bounded timeouts and no retries of its own (the tier
    decides when to try again). Raises ImportError without the redis package."""
    try:
        import redis
    except ImportError:
        raise ImportError("the redis package is not installed (pip install 'prefixd[shared]')") from None
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                retry=Retry(NoBackoff(), 0), health_check_interval=30)
