"""The engine process: one blocking loop over the engine link, no event loop.

    link ──▶ commands (submit, cancel, status, stop) ──▶ applied between rounds
         ◀── `round` messages: token and done events, observer calls (`RoundOutbox`: a
             stream's later tokens join over up to `--stream-interval`)

`EngineLoop.run` sleeps on the link while the engine is idle and, while it is busy, takes
whatever commands have arrived before each round, waiting for more only where the engine
says `pause_before_long()`: once after short work, before a round of long prefills alone, it
waits up to `pause_s` (PAUSE_BEFORE_LONG_S) for the next command, so a client whose short
request just ended (its next one a few milliseconds away) does not find such a round in
flight and wait it out (docs/store.md, *Round policy*). A round that
raises ends every stream of the engine with finish_reason "error" and serving goes on; a
lane that fails alone ends only its stream (the Engine did that). Anything else that
escapes (a bug, out of memory) ends the process, and the front restarts it.

Overlap (`Runtime.overlap`, the daemon's choice on CUDA): each round's device call runs on
a device thread while this loop takes the submits and cancels that arrive and seats waiting
streams for the next round (`Engine.admit_ahead`); a status waits until the round lands.
The front pings a silent engine with a status and takes one that owes an answer too long
for stalled (front/engine_link.py): a status is answered between rounds, never inside one.

While busy the process keeps freed heap for the next round (`retain_freed_memory`); after
`idle_trim_s` with nothing to do it hands that heap back to the system, once per idle spell
(a status alone, such as the front's ping, starts none).

`python -m prefixd.engine FD` runs it in a process of its own (`child_main`): the front
made the socketpair and sends the start spec as the first frame.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import select
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from prefixd.engine.contract import OBSERVED, REFUSAL_CODES, VERSION, EngineSpec, encode, decode, message, \
    pack_object, unpack_object
from prefixd.engine.kv_events import open_kv_events
from prefixd.engine.link import BlockingLink, LinkClosed, inherit
from prefixd.engine.memory import (IDLE_TRIM_S, freeze_loaded_heap, one_malloc_arena, retain_freed_memory,
                                   return_idle_memory)

log = logging.getLogger("prefixd.engine")

DISK_FLUSH_S = 120.0  # at stop, time the disk tier's writer gets to finish its queue
# Once after short work, before a round of long prefills alone: a client's next request
# comes in 1-3 ms on a loaded 2-core machine (bench/flood.py), a long round takes 10-100 ms.
PAUSE_BEFORE_LONG_S = 0.005


class RecordingObserver:
    """An EngineObserver that records its calls; the round message carries them to the front."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name not in OBSERVED:
            raise AttributeError(name)

        def record(*args: Any) -> None:
            self.calls.append([name, [_plain(a) for a in args]])

        setattr(self, name, record)  # later calls find it without this lookup
        return record

    def take(self) -> list[list[Any]]:
        calls, self.calls = self.calls, []
        return calls


def _plain(value: Any) -> Any:
    """An observer argument as msgpack data (the disk tier's stats are a dataclass)."""
    if hasattr(value, "__dataclass_fields__"):
        return {name: getattr(value, name) for name in value.__dataclass_fields__}
    return value


class RoundOutbox:
    """What the engine owes the front: each round's events and observer calls, sent together
    when one is due (`due`), as one `round` message (`take`).

    A stream's first token, every end and every other event goes at once: the first token is
    the request's time to first token, an end is its reply's. Later tokens may wait up to
    `interval_s` to travel with the next rounds', each stream's ids joined into one event: the
    front and the client then wake once for several rounds, not once a round, and a wake after
    a round costs them far more than the bytes (the round has just flushed their caches).
    Whether one more round still fits in the interval is judged by the round just run. 0: every
    round's events go at once."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._events: list[Any] = []
        self._observed: list[Any] = []
        self._since = 0.0  # when the oldest entry waiting was added
        self._urgent = False
        self._started: set[int] = set()  # streams whose first token has gone

    def add(self, events: list[Any], observed: list[Any], now: float) -> None:
        from prefixd.scheduler.streams import TokenEvent

        if not self:
            self._since = now
        for event in events:
            if not isinstance(event, TokenEvent):
                self._started.discard(event.stream_id)
                self._urgent = True
                self._events.append(event)
                continue
            if event.stream_id not in self._started:
                self._started.add(event.stream_id)
                self._urgent = True
            self._join(event)
        self._observed.extend(observed)

    def _join(self, event: Any) -> None:
        """`event` after the stream's waiting tokens: one event holding both's ids."""
        for i in range(len(self._events) - 1, -1, -1):
            held = self._events[i]
            if held.stream_id != event.stream_id:
                continue
            if type(held) is type(event) and (held.logits_sha256 is None) == (event.logits_sha256 is None) \
                    and (held.logprobs is None) == (event.logprobs is None):
                self._events[i] = dataclasses.replace(
                    held, ids=held.ids + event.ids,
                    logits_sha256=None if held.logits_sha256 is None else held.logits_sha256 + event.logits_sha256,
                    logprobs=None if held.logprobs is None else held.logprobs + event.logprobs)
                return
            break
        self._events.append(event)

    def due(self, now: float, round_s: float) -> bool:
        """Whether what waits must go now: something urgent, or one more round of `round_s`
        would take the oldest event past the interval."""
        if not self:
            return False
        return self._urgent or (now - self._since) + round_s >= self.interval_s

    def take(self) -> tuple[list[Any], list[Any]]:
        events, observed = self._events, self._observed
        self._events, self._observed, self._urgent = [], [], False
        return events, observed

    def __bool__(self) -> bool:
        return bool(self._events or self._observed)


class EngineLoop:
    """Serves one engine over one link until told to stop or the link closes."""

    def __init__(self, link: BlockingLink, runtime: Any, observer: RecordingObserver, *,
                 idle_trim_s: float | None = IDLE_TRIM_S, trim: Callable[[], object] = return_idle_memory,
                 kv_events: Any = None, pause_s: float = PAUSE_BEFORE_LONG_S, stream_interval_s: float = 0.0) -> None:
        self.link = link
        self.outbox = RoundOutbox(stream_interval_s)
        self.pause_s = pause_s
        self.kv_events = kv_events  # engine/kv_events.KvEvents, or None
        self.runtime = runtime
        self.engine = runtime.engine
        self.observer = observer
        self._idle_trim_s = idle_trim_s
        self._trim = trim
        self._trim_at: float | None = None  # when an idle spell's trim is due (None: none is)
        self.num_trims = 0
        self.num_failed_rounds = 0
        self._stopping = False
        self._deferred: list[dict[str, Any]] = []
        self._device = ThreadPoolExecutor(1, thread_name_prefix="prefixd-device") if runtime.overlap else None
        self._wake_r, self._wake_w = os.pipe() if runtime.overlap else (-1, -1)

    def run(self) -> None:
        try:
            while not self._stopping:
                engine = self.engine
                if engine.idle:
                    wait = None if self._trim_at is None else self._trim_at - time.monotonic()
                    msgs = self._receive_idle(wait) if wait is None or wait > 0 else None
                    if msgs is None:
                        self._trim_idle()
                        continue
                else:
                    pause = engine.pause_before_long()
                    if pause:
                        self._flush()  # nothing waits through a pause
                    msgs = self.link.receive(self.pause_s if pause else 0) or []
                if self._idle_trim_s is not None and (not engine.idle or any(m.get("t") != "status" for m in msgs)):
                    self._trim_at = time.monotonic() + self._idle_trim_s
                deferred = self._apply(msgs, host_only=False)
                assert not deferred
                if self._stopping:
                    self._flush()
                    break
                started = time.monotonic()
                events = self._step() if not engine.idle else []
                self._report(events, time.monotonic() - started)
                if self.kv_events is not None:
                    self.kv_events.after_round()
                if self._deferred:  # commands that came while an overlapped round ran
                    deferred, self._deferred = self._deferred, []
                    self._apply(deferred, host_only=False)
        except LinkClosed:
            log.info("the front closed the engine link: stopping")
        finally:
            if self._device is not None:
                self._device.shutdown()
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _receive_idle(self, wait: float | None) -> list[dict[str, Any]] | None:
        """`link.receive(wait)`, answering KV-event replay requests while it waits."""
        replay = self.kv_events.fileno() if self.kv_events is not None else None
        if replay is None:
            return self.link.receive(wait)
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            self.kv_events.serve_replay()  # drains the edge-triggered descriptor
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.link, replay], [], [], left)
            if self.link in ready:
                return self.link.receive(0)
            if not ready:
                return None

    # -- commands ---------------------------------------------------------------------------

    def _apply(self, msgs: list[dict[str, Any]], *, host_only: bool) -> list[dict[str, Any]]:
        """Apply commands in order; with `host_only` (a round in flight), a status and all
        after it are returned to run once it lands."""
        for i, msg in enumerate(msgs):
            kind = msg.get("t")
            if kind == "submit":
                self._submit(msg)
            elif kind == "cancel":
                keep = msg.get("keep")
                if keep is None:
                    self.engine.cancel(msg["id"])
                else:
                    self.engine.cancel(msg["id"], keep)
            elif host_only:
                return msgs[i:]
            elif kind == "status":
                self._status(msg)
            elif kind == "stop":
                self._stopping = True
                return []
            else:
                log.error("engine link: unknown command %r", kind)
        return []

    def _submit(self, msg: dict[str, Any]) -> None:
        from prefixd.scheduler.streams import RequestError

        request = decode(msg["request"])
        try:
            self.engine.submit(request)
        except RequestError as e:
            code = e.code if e.code in REFUSAL_CODES else "bad_request"
            self._send(message("refused", id=request.stream_id, code=code, message=e.message))
        else:
            self._send(message("accepted", id=request.stream_id))

    def _status(self, msg: dict[str, Any]) -> None:
        engine = self.engine
        problem = None
        if msg.get("check"):
            try:
                engine.check_integrity()
            except RuntimeError as e:
                problem = str(e)
        device = self.runtime.device_status() if self.runtime.device_status is not None else {}
        if self.kv_events is not None:
            device = {**device, "kv_events": self.kv_events.status()}
        self._send(message("status", q=msg["q"], status=encode({**engine.status(), **device}), idle=engine.idle,
                               integrity=problem, trims=self.num_trims, failed_rounds=self.num_failed_rounds))

    # -- rounds -----------------------------------------------------------------------------

    def _step(self) -> list[Any]:
        """One round. A failed round, the device's own failure, ends every stream with "error"."""
        try:
            events = self._overlapped_round() if self._device is not None else self._round()
        except Exception as e:
            log.exception("lane round failed; ending every stream with finish_reason error")
            self.num_failed_rounds += 1
            return self.engine.abort(f"the device failed during a lane round: {e!r}")
        for event in events:
            if getattr(event, "finish_reason", None) == "error":
                log.warning("stream %d ended with error: %s", event.stream_id, event.note)
        return events

    def _round(self) -> list[Any]:
        if self.runtime.before_round is not None:
            self.runtime.before_round()
        return self.engine.step()

    def _overlapped_round(self) -> list[Any]:
        engine = self.engine
        launched = engine.launch()
        if launched.plan.empty:
            return engine.land(launched, None)
        assert self._device is not None
        running: Future = self._device.submit(self._run_on_device, launched)
        running.add_done_callback(lambda _: os.write(self._wake_w, b"."))
        deferred: list[dict[str, Any]] = []
        try:
            while not running.done():
                # once a status waits for the landing, the link waits too: its bytes would wake this loop for nothing
                watched = [self._wake_r] if deferred else [self.link, self._wake_r]
                ready, _, _ = select.select(watched, [], [])
                if self._wake_r in ready:
                    os.read(self._wake_r, 64)
                if self.link in ready and not deferred:
                    deferred = self._apply(self.link.receive(0) or [], host_only=True)
                engine.admit_ahead(launched)
        except BaseException:
            running.exception()  # the device finishes its round before the engine gives up on it
            raise
        self._deferred = deferred
        return engine.land(launched, running.result())

    def _run_on_device(self, launched: Any) -> Any:
        if self.runtime.before_round is not None:
            self.runtime.before_round()  # torch keeps CPU thread counts per thread: set them where rounds run
        return self.engine.run(launched)

    def _report(self, events: list[Any], round_s: float) -> None:
        """The round's events and observer calls into the outbox; sent when due, or when the
        engine has nothing left to run (no round follows to carry them)."""
        for event in events:
            if hasattr(event, "usage"):
                log_done(event)
        now = time.monotonic()
        self.outbox.add(events, self.observer.take(), now)
        if self.engine.idle or self.outbox.due(now, round_s):
            self._flush()

    def _flush(self) -> None:
        if not self.outbox:
            return
        events, observed = self.outbox.take()
        allocator = self.engine.allocator
        self.link.send(message("round", events=[encode(e) for e in events], observed=observed,
                               pages=[allocator.num_free, allocator.num_used]), inline=True)

    def _send(self, msg: dict[str, Any]) -> None:
        """A reply after every round message owed: the front sees the engine's messages in order."""
        self._flush()
        self.link.send(msg)

    def _trim_idle(self) -> None:
        self._trim_at = None
        self._trim()
        self.num_trims += 1
        log.debug("engine idle for %.1fs: returned freed heap to the system", self._idle_trim_s)

    def close(self) -> None:
        """Release the device and flush the disk tier (after `run` returned)."""
        self.engine.close()
        disk = getattr(self.runtime, "disk", None)
        if disk is not None:
            disk.close(DISK_FLUSH_S)  # every queued entry file is written
            sys.stderr.write(f"prefixd: disk cache flushed ({disk.stats().entries} entries)\n")
            sys.stderr.flush()


def log_done(event: Any) -> None:
    """One info line per finished request (a DoneEvent): id, tokens, cache, TTFT, finish reason."""
    u = event.usage
    log.info("request %d %s: prompt %d tokens, %d cached (%s), %d generated, ttft %.3fs, total %.3fs%s",
             event.stream_id, event.finish_reason, u.prompt_tokens, u.cached_tokens, u.cache,
             u.completion_tokens, u.ttft_s, u.total_s, f" ({event.note})" if event.note else "")


def ready_message(runtime: Any, local: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the front needs of a loaded runtime: the model summary, the tokenizer, warnings.
    `local`: the engine runs in the front's own process (a thread), and the tokenizer is
    handed over there as the object itself rather than pickled."""
    from prefixd.daemon.config import cache_budget_warning

    engine = runtime.engine
    warning = cache_budget_warning(engine.info, engine.config)
    allocator = engine.allocator
    if local is not None:
        local["tokenizer"] = runtime.tokenizer
    tokenizer = pack_object(runtime.tokenizer) if local is None else None
    return message("ready", version=VERSION, model_info=runtime.model_info, tokenizer=tokenizer,
                   warnings=[warning] if warning else [], pages=[allocator.num_free, allocator.num_used],
                   pid=os.getpid())


def _is_model_error(error: Exception) -> bool:
    """A load that failed on the model file itself (missing, unreadable, unsupported)."""
    try:
        from prefixd.gpu.loading import ModelLoadError
    except ImportError:
        return False
    return isinstance(error, ModelLoadError)


def resolve_factory(spec: EngineSpec) -> Callable[[Any, Any], Any]:
    module, _, name = spec.factory.partition(":")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target(**spec.factory_args) if spec.factory_args is not None else target


def serve_link(link: BlockingLink, factory: Callable[[Any, Any], Any], config: Any, *,
               local: dict[str, Any] | None = None) -> int:
    """Load with `factory`, say ready, serve until stopped; the process's exit code."""
    from prefixd.daemon.startup import StartupError

    observer = RecordingObserver()
    retain_freed_memory()
    try:
        runtime = factory(config, observer)
    except StartupError as e:
        link.send(message("failed", message=str(e), startup=True))
        return 2
    except Exception as e:  # noqa: BLE001 - reported to the front, which says it to the user
        if _is_model_error(e):
            link.send(message("failed", message=f"cannot load model: {e}", startup=True))
            return 1
        log.exception("the engine could not load")
        link.send(message("failed", message=f"{type(e).__name__}: {e}", startup=False))
        return 1
    observer.take()  # the load's own observations are not a round's
    try:
        kv_events = open_kv_events(config, runtime.engine)
    except StartupError as e:
        link.send(message("failed", message=str(e), startup=True))
        return 2
    freeze_loaded_heap()
    link.send(ready_message(runtime, local))
    loop = EngineLoop(link, runtime, observer, kv_events=kv_events,
                      stream_interval_s=getattr(config, "stream_interval_s", 0.0))
    try:
        loop.run()
    finally:
        loop.close()
        if kv_events is not None:
            kv_events.close()
    return 0


def child_main(argv: list[str]) -> int:
    """`python -m prefixd.engine FD`: the engine process the front started."""
    # The front decides when the engine stops (SIGTERM to the unit reaches every process of
    # its cgroup; the engine still has to flush the disk tier when the front says so).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    one_malloc_arena()  # before any thread (the disk writer, torch's pool, the device thread)
    link = BlockingLink(inherit(int(argv[0])))
    try:
        first = link.receive(None) or []
    except LinkClosed:
        return 1
    if not first or first[0].get("t") != "start":
        sys.stderr.write("prefixd-engine: the first frame was not a start\n")
        return 1
    spec: EngineSpec = unpack_object(first[0]["spec"])
    logging.basicConfig(level=spec.log_level.upper(), format="prefixd %(levelname)s %(name)s: %(message)s")
    sys.path[:0] = [p for p in spec.sys_path if p not in sys.path]
    started = time.monotonic()
    try:
        factory = resolve_factory(spec)
        return serve_link(link, factory, spec.config)
    except LinkClosed:
        return 0
    finally:
        log.debug("engine process ran %.1fs", time.monotonic() - started)
        link.close()
