"""A Device in plain Python for scheduler tests.

KV pages really hold what was written: each row stores its token id, and a row's "logits"
are a hash of the tokens read back through the lane's page table (plus, for a non-invariant
family, the lane's recurrent state). A wrong page table, a missed copy-on-write or a
restore of the wrong state therefore changes the sampled tokens.

Non-invariant mode imitates a recurrent family: the state after a prefill chunk hashes the
whole chunk, a decode row hashes its one token with another tag, so rows are reproduced only
when computed with the same chunking.

`run_round` is the only call the engine makes: it runs a plan's items in `RoundPlan`'s
documented order (the disk tier's loads and exports included), and any other method reached
for raises (`SideCallError`).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

from prefixd.scheduler.device import DeviceInfo
from prefixd.scheduler.records import (CapturedState, DiskLoad, LaneResult, LaneWork, PageExport, PagePayload,
                                       RoundPlan, RoundResult, StoredSample, made)

POISON = "nan"  # what a failed lane leaves in its rows: any later read of them changes a hash


class SideCallError(AssertionError):
    """The scheduler asked the device for something outside a round."""


def fake_digest(value: int) -> str:
    """A fake logits row's "sha256": its hash value in 64 hex digits (so tests can read it back)."""
    return format(value, "064x")


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class FakeRows:
    """Logits rows: one hash per row stands in for a float32 row."""

    values: tuple[int, ...]
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return len(self.values) * self.row_bytes


@dataclass(frozen=True)
class FakeState:
    value: int
    nbytes: int


def make_info(
    *,
    num_lanes: int = 8,
    num_pages: int = 64,
    page_size: int = 4,
    max_context: int = 64,
    vocab_size: int = 1000,
    invariant_rows: bool = True,
    lane_state_bytes: int | None = None,
) -> DeviceInfo:
    return DeviceInfo(
        num_lanes=num_lanes,
        num_pages=num_pages,
        page_size=page_size,
        max_context=max_context,
        vocab_size=vocab_size,
        kv_bytes_per_page=1024,
        lane_state_bytes=(0 if invariant_rows else 256) if lane_state_bytes is None else lane_state_bytes,
        logits_row_bytes=vocab_size * 4,
        weights_bytes=10_000,
        workspace_bytes_per_row=8,
        invariant_rows=invariant_rows,
    )


@dataclass
class _Sampler:
    seed: int
    greedy: bool
    first_position: int = 0


@dataclass
class FakeDevice:
    info: DeviceInfo = field(default_factory=make_info)
    plans: list[RoundPlan] = field(default_factory=list)
    copied_bytes: int = 0  # page copies + restores
    resets: list[int] = field(default_factory=list)
    starts: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (lane, history)
    # fault(work) -> an error for that lane alone (its rows are then poisoned), or None
    fault: Callable[[LaneWork], str | None] | None = None
    # stored_fault(item) -> an error for a stored-row sample (that lane alone), or None
    stored_fault: Callable[[StoredSample], str | None] | None = None
    closed: bool = False

    def __post_init__(self) -> None:
        p = self.info.page_size
        self.pool: list[list[int | None]] = [[None] * p for _ in range(self.info.num_pages)]
        self.state: list[int] = [0] * self.info.num_lanes
        self.samplers: dict[int, _Sampler] = {}
        self.exported: list[tuple[int, ...]] = []  # pages of each export_pages, in order
        self.loaded: list[tuple[int, ...]] = []  # pages of each load_pages, in order

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise SideCallError(f"device.{name} called outside run_round: the round is the only device call")

    # -- Device protocol --------------------------------------------------------------

    def run_round(self, plan: RoundPlan) -> RoundResult:
        if self.closed:
            raise SideCallError("run_round after close")
        self.plans.append(plan)
        self._check(plan)
        for load in plan.loads:
            self._load(load)
        exported = tuple(self._export(item) for item in plan.exports)
        for lane in plan.resets:
            self.state[lane] = 0
            self.resets.append(lane)
        for item in plan.restores:
            self.state[item.lane] = made(item.state).value
            self.copied_bytes += item.state.nbytes
        for copy in plan.page_copies:
            self.pool[copy.dst] = list(self.pool[copy.src])
            self.copied_bytes += self.info.kv_bytes_per_page
        for item in plan.samplers:
            self.samplers[item.lane] = _Sampler(seed=item.sampling.seed or 0, greedy=item.sampling.greedy,
                                                first_position=len(item.history))
            self.starts.append((item.lane, tuple(item.history)))
        stored = tuple(self._sample_stored(item) for item in plan.stored)
        results = []
        for work in plan.lanes:
            error = self.fault(work) if self.fault is not None else None
            if error is not None:
                self._poison(work)
                results.append(LaneResult(lane=work.lane, error=error))
                continue
            values = self._forward(work)
            sampled = self._verify(work, values) if work.drafts else tuple(
                self._pick(work.lane, values[i], work.start + i + 1) for i in work.sample_rows)
            logits = FakeRows(tuple(values[i] for i in work.logits_rows), self.info.logits_row_bytes) if work.logits_rows else None
            digests = tuple(fake_digest(values[i]) for i in work.digest_rows)
            results.append(LaneResult(lane=work.lane, sampled=sampled, logits=logits, digests=digests))
        return RoundResult(tuple(results), forward_s=0.0, stored=stored, captured=self._captures(plan),
                           exported=exported)

    def close(self) -> None:
        self.closed = True

    # -- plan items -------------------------------------------------------------------

    def _check(self, plan: RoundPlan) -> None:
        for name, lanes in (("lanes", [w.lane for w in plan.lanes]),
                            ("resets/restores", [*plan.resets, *(r.lane for r in plan.restores)]),
                            ("stored", [s.lane for s in plan.stored]), ("captures", [c.lane for c in plan.captures])):
            if len(set(lanes)) != len(lanes):
                raise AssertionError(f"a lane appears twice in the plan's {name}: {plan}")
        worked = {w.lane for w in plan.lanes}
        for item in plan.stored:
            if item.lane in worked:
                raise AssertionError(f"lane {item.lane} samples a stored row and runs rows in one round")

    def _sample_stored(self, item: StoredSample) -> LaneResult:
        error = self.stored_fault(item) if self.stored_fault is not None else None
        if error is not None:
            return LaneResult(lane=item.lane, error=error)
        value = made(item.logits).values[item.row]
        digests = (fake_digest(value),) if item.digest else ()
        token = self._pick(item.lane, value, self.samplers[item.lane].first_position)
        return LaneResult(lane=item.lane, sampled=(token,), digests=digests)

    def _captures(self, plan: RoundPlan) -> tuple[CapturedState, ...]:
        return tuple(CapturedState(c.lane, c.cut, FakeState(self.state[c.lane], self.info.lane_state_bytes))
                     for c in plan.captures)

    # -- the disk tier's items ----------------------------------------------------------

    def _export(self, item: PageExport) -> PagePayload:
        """Each page as its rows' token ids (int64, -1 unwritten), padded to kv_bytes_per_page."""
        pages, state, logits = item.pages, made(item.state), made(item.logits)
        bpp = self.info.kv_bytes_per_page
        kv = b"".join(array("q", [-1 if t is None else t for t in self.pool[p]]).tobytes().ljust(bpp, b"\0")
                      for p in pages)
        st = struct.pack("<Q", state.value).ljust(state.nbytes, b"\0") if state is not None else None
        lg = b"".join(struct.pack("<Q", v).ljust(logits.row_bytes, b"\0") for v in logits.values) if logits else None
        self.exported.append(tuple(pages))
        return PagePayload(kv, st, lg)

    def _load(self, load: DiskLoad) -> None:
        bpp, p = self.info.kv_bytes_per_page, self.info.page_size
        for pl in load.pages:
            data = bytes(pl.kv)
            if len(data) != len(pl.pages) * bpp:
                raise AssertionError(f"{len(data)} bytes for {len(pl.pages)} pages")
            for i, page in enumerate(pl.pages):
                rows = array("q", data[i * bpp: i * bpp + 8 * p])
                self.pool[page] = [None if t < 0 else t for t in rows]
        self.loaded.append(tuple(pg for pl in load.pages for pg in pl.pages))
        state = FakeState(struct.unpack_from("<Q", load.state)[0], len(load.state)) if load.state is not None else None
        rb = self.info.logits_row_bytes
        logits = None
        if load.logits is not None:
            raw = bytes(load.logits)
            logits = FakeRows(tuple(struct.unpack_from("<Q", raw, i)[0] for i in range(0, len(raw), rb)), rb)
        if load.state_to is not None:
            load.state_to.made = state
        if load.logits_to is not None:
            load.logits_to.made = logits

    # -- the fake model ---------------------------------------------------------------

    def _forward(self, work) -> list[int]:
        p = self.info.page_size
        end = work.start + len(work.tokens)
        if len(work.page_table) < -(-end // p):
            raise AssertionError(f"lane {work.lane}: page table {work.page_table} does not cover {end} rows")
        for i, tok in enumerate(work.tokens):
            pos = work.start + i
            self.pool[work.page_table[pos // p]][pos % p] = tok
        if not self.info.invariant_rows:
            tag = "chunk" if work.prefill else "step"
            self.state[work.lane] = _h(self.state[work.lane], tag, work.tokens)
        values = []
        for i in range(len(work.tokens)):
            context = self.read(work.page_table, work.start + i + 1)
            values.append(_h(context, self.state[work.lane]) if not self.info.invariant_rows else _h(context))
        return values

    def _poison(self, work: LaneWork) -> None:
        p = self.info.page_size
        for pos in range(work.start, work.start + len(work.tokens)):
            self.pool[work.page_table[pos // p]][pos % p] = POISON  # type: ignore[call-overload]
        self.state[work.lane] = _h(POISON)

    def read(self, page_table: Sequence[int], rows: int) -> tuple[int, ...]:
        """The token ids stored in rows [0, rows) through `page_table`."""
        p = self.info.page_size
        out = []
        for pos in range(rows):
            tok = self.pool[page_table[pos // p]][pos % p]
            if tok is None:
                raise AssertionError(f"row {pos} read before it was written (page {page_table[pos // p]})")
            out.append(tok)
        return tuple(out)

    def _pick(self, lane: int, value: int, position: int) -> int:
        """Greedy: a function of the row; sampled: of the row, the seed and the position."""
        sampler = self.samplers[lane]
        if sampler.greedy:
            return value % self.info.vocab_size
        return _h(value, sampler.seed, position) % self.info.vocab_size

    def _verify(self, work, values: list[int]) -> tuple[int, ...]:
        """Verify rows as the real device samples them: up to the first rejected draft."""
        out = []
        for i in range(len(work.tokens)):
            out.append(self._pick(work.lane, values[i], work.start + i + 1))
            if i == len(work.drafts) or out[-1] != work.drafts[i]:
                break
        return tuple(out)


def reference_tokens(prompt: Sequence[int], max_tokens: int, vocab_size: int = 1000) -> list[int]:
    """What greedy decoding of `prompt` yields on an invariant fake device (no stops)."""
    seq = list(prompt)
    out = []
    for _ in range(max_tokens):
        tok = _h(tuple(seq)) % vocab_size
        out.append(tok)
        seq.append(tok)
    return out


def run_until_idle(engine, max_steps: int = 10_000) -> list:
    """Step `engine` until idle (checking integrity after every round); returns all events."""
    events = []
    for _ in range(max_steps):
        if engine.idle:
            return events
        events.extend(engine.step())
        engine.check_integrity()
    raise AssertionError(f"engine not idle after {max_steps} steps")


def tokens_by_stream(events) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ev in events:
        if hasattr(ev, "ids"):
            out.setdefault(ev.stream_id, []).extend(ev.ids)
    return out


def done_by_stream(events) -> dict:
    return {ev.stream_id: ev for ev in events if hasattr(ev, "finish_reason")}
