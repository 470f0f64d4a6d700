"""ModelRunner: the torch implementation of `prefixd.scheduler.device.Device`.

`run_round` is the only call the scheduler makes. It runs a `RoundPlan` in its fixed order:
disk loads and exports, resets, restores, page copies, sampler set-up, stored-row samples, then
one batched forward (the plan's lanes concatenated into one row batch; every row's K/V goes
into its lane's pages, attention reads only through each lane's page table, and the lm_head
runs only on rows that are sampled, returned or digested), the samples, and the captures.
Verify rows (a lane's `LaneWork.drafts`) are sampled up to the first rejected draft, and the
lane's state is rolled back to the last accepted row in the same round, by a copy that may
still be in flight when the round returns: every reset, restore and capture waits for it. A runner with a draft
head (`draft_head=True`, a qwen3_5 checkpoint with MTP layers) then runs the head's rows for
every lane and returns its proposals with the lane's result (`gpu.families.qwen3_5_draft`).
A round of decode and verify rows may run as a fixed program instead of op by op, replayed
as a CUDA graph (`gpu.programs`, `programs=`): the same bits, the same results.

A failure that belongs to one lane ends that lane alone (`LaneResult.error`): image rows of the
wrong shape keep the lane out of the forward; a non-finite logits row or a sampler error is
found per lane after it (a stored-row sample included). Other lanes' rows never read the failed
lane's (attention reads only through each lane's page table), so their bits are unchanged. A
failure of the forward itself raises: the device, not one lane, failed.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from contextlib import nullcontext
from typing import Any, Sequence

import numpy as np
import torch

from prefixd.gpu import kernels
from prefixd.gpu.attention import AttentionSpan, plan_attention
from prefixd.gpu.constrain import GrammarMask, held_masks
from prefixd.gpu.copy import CopyEngine
from prefixd.gpu.digest import logits_sha256
from prefixd.gpu.families import build_family
from prefixd.gpu.families.qwen3_5_draft import MtpDrafts
from prefixd.gpu.kv_pool import KVPool, kv_pages
from prefixd.gpu.model import RoundInputs
from prefixd.gpu.programs import DecodePrograms
from prefixd.gpu.sampling import LaneSampler
from prefixd.scheduler.device import DeviceInfo
from prefixd.gpu.families.qwen3_5_state import HybridState
from prefixd.scheduler.records import (CapturedState, DiskLoad, LaneResult, LaneWork, PageCopy, PageExport,
                                       PagePayload, RoundPlan, RoundResult, SamplerSetup, SamplingParams,
                                       StoredSample, made)
from prefixd.text.grammar import ll_tokenizer

# Errors a lane's sampler may raise on its own row; device-wide ones (a CUDA fault, no memory)
# are re-raised so that the round fails as a whole.
_LANE_ERRORS = (RuntimeError, ValueError, ArithmeticError)
_DEVICE_ERRORS = (torch.AcceleratorError, torch.OutOfMemoryError)


class ModelRunner:
    """Runs rounds for `num_lanes` lanes over a pool of `num_pages` KV pages."""

    def __init__(self, checkpoint: Any, *, device: torch.device, dtype: torch.dtype, num_lanes: int,
                 num_pages: int, page_size: int = 16, mode: str = "invariant", draft_head: bool = False,
                 programs: str = "auto") -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.mode = mode
        if self.device.type == "cpu":
            kernels.check_cpu_products()  # refuse a CPU library whose rows' bits follow the round
        self.tokenizer = checkpoint.tokenizer
        self.config = config = checkpoint.config
        self.model = build_family(checkpoint, self.device, dtype, mode)
        if programs not in ("auto", "eager", "off"):
            raise ValueError(f"programs {programs!r}: auto, eager or off")
        # decode rounds as fixed programs (programs.py): captured as CUDA graphs under "auto"
        use_programs = self.model.decode_programs and not draft_head and (
            programs == "eager" or (programs == "auto" and self.device.type == "cuda"))
        self.model.new_lane_states(num_lanes + 1 if use_programs else num_lanes)  # + the programs' scratch lane
        scratch = num_lanes if draft_head else 0  # a page per lane for chained MTP passes
        scratch += 1 if use_programs else 0  # the page the programs' padding rows write
        self.kv = KVPool(num_layers=self.model.num_kv_layers, num_pages=num_pages + scratch, page_size=page_size,
                         num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                         device=self.device, dtype=dtype, **kv_pages(self.model.mode, config.head_dim))
        self.info = DeviceInfo(
            num_lanes=num_lanes, num_pages=num_pages, page_size=page_size,
            max_context=config.max_context, vocab_size=config.vocab_size,
            kv_bytes_per_page=self.kv.bytes_per_page, lane_state_bytes=self.model.lane_state_bytes,
            logits_row_bytes=4 * config.vocab_size, weights_bytes=int(checkpoint.weights_bytes),
            workspace_bytes_per_row=self.model.workspace_bytes_per_row,
            invariant_rows=self.model.invariant_rows, lookahead=1 if draft_head else 0, draft_head=draft_head)
        self.drafts = MtpDrafts(self.model, self.kv, scratch_base=num_pages) if draft_head else None
        self.programs = DecodePrograms(self.model, self.kv, num_lanes=num_lanes, scratch_page=num_pages,
                                       capture=programs == "auto") if use_programs else None
        self.copies = CopyEngine(self.device)  # page and state copies, fenced
        self._samplers: dict[int, LaneSampler] = {}
        vocab = self.tokenizer.vocab_size if self.tokenizer is not None else config.vocab_size
        self._tokenizer_vocab = min(vocab, config.vocab_size)  # ids at or past it are never sampled
        self._ll_tokenizer: Any = None

    # Device protocol -------------------------------------------------------------------
    def run_round(self, plan: RoundPlan) -> RoundResult:
        self._check_plan(plan)
        # the calling thread's current CUDA device may be another (the daemon's device thread)
        with torch.inference_mode(), torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            if plan.loads or plan.exports:
                self.copies.wait_all()  # no copy still writes a page or state these read or replace
            for load in plan.loads:
                self._load(load)
            exported = tuple(self._export(item) for item in plan.exports)
            self._before_forward(plan)
            stored = tuple(self._sample_stored(item) for item in plan.stored)
            lanes, forward_s = self._forward(plan.lanes) if plan.lanes else ((), 0.0)
            if plan.captures:
                self.copies.wait_all()  # a capture never holds a row an in-flight copy is replacing
            captured = tuple(CapturedState(c.lane, c.cut, self.model.capture(c.lane)) for c in plan.captures)
        return RoundResult(lanes=lanes, forward_s=forward_s, stored=stored, captured=captured, exported=exported)

    def close(self) -> None:
        """Let every copy land and drop the samplers; the weights go with the runner."""
        self.copies.wait_all()
        self._samplers.clear()

    # Plan steps before the forward --------------------------------------------------------
    def _before_forward(self, plan: RoundPlan) -> None:
        if plan.resets or plan.restores:
            self.copies.wait_all()  # a rolled-back row must never land after a reset or restore
        for lane in plan.resets:
            self.model.reset(lane)
        for item in plan.restores:
            self.model.restore(item.lane, made(item.state))
        self._copy_pages(plan.page_copies)
        for item in plan.samplers:
            self._samplers[item.lane] = self._new_sampler(item)
        self.copies.wait_all()  # a round must not read pages a copy is still writing

    def _rollback(self, lane: int, num_rows: int) -> int:
        """Keep the first `num_rows` rows of the lane's verify rows (a rejected draft tail).
        KV rows past them are simply overwritten later; a family with lane state restores it
        from its per-row record. The copy is issued on the copy engine and may still be in
        flight on return: every later round, capture, restore and reset waits for it.
        Returns bytes copied (0 for attention-only families)."""
        rollback_copy = getattr(self.model, "rollback_copy", None)
        if rollback_copy is None:
            return 0
        src, dst = rollback_copy(lane, num_rows)
        return self.copies.scatter([src], [dst]).nbytes

    def _copy_pages(self, copies: Sequence[PageCopy]) -> None:
        """Copy pages of every attention layer in plan order: a batch goes to the copy engine in one
        launch until a page it would write is one an earlier copy of the batch reads, or the reverse."""
        batch: list[PageCopy] = []
        for copy in copies:
            touched = {c.src for c in batch} | {c.dst for c in batch}
            if copy.src in touched or copy.dst in touched:
                self._launch_copies(batch)
                batch = []
            batch.append(copy)
        self._launch_copies(batch)

    def _launch_copies(self, batch: list[PageCopy]) -> None:
        if batch:
            self.copies.copy_pages(self.kv.pools(), [c.src for c in batch], [c.dst for c in batch]).wait()

    def _new_sampler(self, item: SamplerSetup) -> LaneSampler:
        return LaneSampler(item.sampling, item.history, vocab_size=self.config.vocab_size,
                           tokenizer_vocab=self._tokenizer_vocab, device=self.device,
                           constraint=self._constraint(item.sampling))

    def _constraint(self, sampling: SamplingParams) -> GrammarMask | None:
        if sampling.grammar is None:
            return None
        if self._ll_tokenizer is None:  # built on first use: ~1 s for a large vocabulary
            self._ll_tokenizer = ll_tokenizer(self.tokenizer)
        # off the CPU the next row's mask is built on the mask worker while the round's forward
        # runs; on the CPU every lane's is built together once the round has sampled (held_masks
        # in _forward): a worker beside the forward slowed its 2-core int4 products more than
        # the masks cost (bench/constrain.py)
        return GrammarMask(self._ll_tokenizer, sampling.grammar, vocab_size=self.config.vocab_size,
                           background=self.device.type != "cpu")

    def _sample_stored(self, item: StoredSample) -> LaneResult:
        """The lane's first token from a stored logits row, or the lane's error."""
        row = made(item.logits)[item.row]
        if not bool(torch.isfinite(row).all()):
            return LaneResult(item.lane, error="the stored logits row is not finite (NaN or inf)")
        digests = logits_sha256(row) if item.digest else ()
        sampler = self._sampler(item.lane)
        try:
            token = sampler.sample(row, sampler.first_position)
        except _DEVICE_ERRORS:
            raise
        except _LANE_ERRORS as e:
            return LaneResult(item.lane, error=f"sampling failed: {e}")
        logprobs = (sampler.last_logprob,) if sampler.params.logprobs is not None else None
        return LaneResult(lane=item.lane, sampled=(token,), digests=digests, logprobs=logprobs)

    # The disk tier's items: loads and exports ----------------------------------------------
    def _export(self, item: PageExport) -> PagePayload:
        """Host copies for the disk tier: the pages page-major (n, 2, layers, P, kv_heads,
        head_dim), the lane state's bytes and the float32 logits rows. The disk tier's writer
        thread only reads the returned buffers."""
        state, logits = made(item.state), made(item.logits)
        idx = torch.tensor(list(item.pages), dtype=torch.long, device=self.device)
        # page-major (n, 2, L, P, H, D), one gather: a file's leading pages are a byte prefix
        kv = self.kv.storage.permute(2, 0, 1, 3, 4, 5).index_select(0, idx)
        return PagePayload(kv=_host_bytes(kv), state=None if state is None else _host_bytes(state.data),
                           logits=None if logits is None else _host_bytes(logits))

    def _load(self, load: DiskLoad) -> None:
        """Write the load's page bytes into their pages (one copy from the read buffer into the
        pool); the state and logits row become device tensors made from the bytes, set on the
        load's `state_to` / `logits_to`."""
        shape = self.kv.storage.shape  # (2, L, num_pages, P, H, D)
        for pl in load.pages:
            if not pl.pages:
                continue
            src = torch.frombuffer(pl.kv, dtype=torch.uint8).view(self.kv.dtype)
            src = src.view(len(pl.pages), shape[0], shape[1], *shape[3:]).to(self.device)  # (n, 2, L, P, H, D)
            idx = torch.tensor(list(pl.pages), dtype=torch.long, device=self.device)
            self.kv.storage.index_copy_(2, idx, src.permute(1, 2, 0, 3, 4, 5))
        state = None
        if load.state is not None:
            # clones: the snapshot must not keep the whole read buffer (its pages) alive
            state = HybridState(torch.frombuffer(load.state, dtype=torch.uint8).to(self.device).clone())
        logits = None
        if load.logits is not None:
            rows = torch.frombuffer(load.logits, dtype=torch.float32).view(-1, self.config.vocab_size)
            logits = rows.to(self.device).clone()
        if load.state_to is not None:
            load.state_to.made = state
        if load.logits_to is not None:
            load.logits_to.made = logits

    def kv_rows(self, layer: int, page_table: Sequence[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (n, kv_heads, head_dim) of attention layer `layer`, for tests."""
        return self.kv.rows(layer, page_table, n)

    # Round assembly ---------------------------------------------------------------------
    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane < self.info.num_lanes:
            raise ValueError(f"lane {lane} outside [0, {self.info.num_lanes})")

    def _sampler(self, lane: int) -> LaneSampler:
        if lane not in self._samplers:
            raise RuntimeError(f"lane {lane} samples before a SamplerSetup (start of its stream)")
        return self._samplers[lane]

    def _forward(self, work: tuple[LaneWork, ...]) -> tuple[tuple[LaneResult, ...], float]:
        """The forward over every lane whose image rows fit, then each lane's result (its error
        alone when its rows are not finite or its sampler fails)."""
        refused = {w.lane: err for w in work if (err := self._image_error(w)) is not None}
        runnable = RoundPlan(tuple(w for w in work if w.lane not in refused))
        results = {lane: LaneResult(lane, error=err) for lane, err in refused.items()}
        forward_s = 0.0
        program = self.programs.pick(runnable.lanes) if self.programs is not None and runnable.lanes else None
        if program is not None:
            t0 = time.perf_counter()
            rows = program.run(runnable.lanes)  # every bucket row's logits
            wanted, where = self._wanted_rows(runnable, [program.row(i, 0) for i in range(len(runnable.lanes))])
            logits = rows.index_select(0, self._long(wanted)) if where else None
            self._sample(runnable, logits, where, results)
            forward_s = time.perf_counter() - t0
        elif runnable.lanes:
            # the model builds the round's set-up itself from the lanes (mode int4's one call), or
            # takes it from the runner's RoundInputs
            host = getattr(self.model, "host_rounds", False) and self.drafts is None and not any(
                w.images for w in runnable.lanes)
            inputs = None if host else self._inputs(runnable)
            t0 = time.perf_counter()
            carries = self.drafts.carries(runnable.lanes) if self.drafts is not None else {}
            first_rows = list(itertools.accumulate((len(w.tokens) for w in runnable.lanes[:-1]), initial=0))
            wanted, where = self._wanted_rows(runnable, first_rows)
            every = len(where) == first_rows[-1] + len(runnable.lanes[-1].tokens)
            logits = picks = None
            if host:
                hidden, logits, picks = self.model.forward_host(runnable.lanes, self.kv, head=every,
                                                                pick_below=self._tokenizer_vocab)
            elif every and hasattr(self.model, "forward_logits"):
                # every row's logits, in row order (a decode round): the model may take the head in
                # its call, and pick greedy tokens and screen the rows as it stores them
                hidden, logits, picks = self.model.forward_logits(inputs, self.kv, pick_below=self._tokenizer_vocab)
            else:
                hidden = self.model.forward(inputs, self.kv)
            if logits is None and where:
                logits = self.model.logits(hidden.index_select(0, self._long(wanted)))
            self._sample(runnable, logits, where, results, picks)
            if self.drafts is not None:
                self._propose(runnable.lanes, inputs, hidden, carries, results)
            forward_s = time.perf_counter() - t0
        return tuple(results[w.lane] for w in work), forward_s

    def _sample(self, plan: RoundPlan, logits: torch.Tensor | None, where: dict,
                results: dict[int, LaneResult], picks: list[int] | None = None) -> None:
        """Each lane's result from the logits of its wanted rows (`_wanted_rows`); `picks`: each
        row's greedy pick, -1 where the row is not finite, where the model's call made them as
        it stored the logits (`forward_logits`), so that neither the screen nor a `greedy_alone`
        lane reads the row again."""
        if picks is not None:
            finite, greedy = [p >= 0 for p in picks], picks
        else:
            finite, greedy = (_finite_rows(logits) if logits is not None else []), None
        with held_masks():  # next masks are built once every lane has sampled (constrain.py)
            results.update((w.lane, self._lane_result(w, logits, where, finite, greedy)) for w in plan.lanes)

    def _propose(self, works: tuple[LaneWork, ...], inputs: RoundInputs, hidden: torch.Tensor,
                 carries: dict, results: dict[int, LaneResult]) -> None:
        """The draft head's rows for the round's lanes; its proposals join their results."""
        first_rows = [span.row for span in inputs.spans]
        for lane, (proposals, p) in self.drafts.run(works, first_rows, hidden, carries, results).items():
            results[lane] = dataclasses.replace(results[lane], proposals=proposals, proposal_p=p)

    def _check_plan(self, plan: RoundPlan) -> None:
        """Raise ValueError (running nothing) on a plan the device cannot run as asked.

        The plan's shape only: token ids and page ids are not re-checked each round (the engine
        refuses a request with a token outside the vocabulary at submit, and every page id comes
        from its allocator of `info.num_pages` pages)."""
        seen: set[int] = set()
        for w in plan.lanes:
            self._check_work(w, seen)
        for lane in (*plan.resets, *(r.lane for r in plan.restores), *(s.lane for s in plan.samplers),
                     *(s.lane for s in plan.stored), *(c.lane for c in plan.captures)):
            self._check_lane(lane)
        for c in plan.page_copies:
            if c.src == c.dst:
                raise ValueError(f"page copy {c.src} -> {c.dst} onto itself")
        set_up = {s.lane for s in plan.samplers}
        for lane in {*(s.lane for s in plan.stored), *(w.lane for w in plan.lanes if w.sample_rows)}:
            if lane not in set_up and lane not in self._samplers:
                raise RuntimeError(f"lane {lane} samples before a SamplerSetup (start of its stream)")

    def _inputs(self, plan: RoundPlan) -> RoundInputs:
        p = self.info.page_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans = []
        for w in plan.lanes:
            pos = range(w.start, w.start + len(w.tokens))
            spans.append(AttentionSpan(len(tokens), w.start, len(w.tokens), tuple(w.page_table)))
            tokens += w.tokens
            positions += pos
            slots += [w.page_table[i // p] * p + i % p for i in pos]
        n = len(tokens)
        padded = self.model.padded_rows(n)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        group = self.config.num_heads // self.config.num_kv_heads
        return RoundInputs(
            tokens=as_long(tokens + [0] * (padded - n)), positions=as_long(positions + [0] * (padded - n)),
            num_rows=n, slots=as_long(slots), spans=tuple(spans),
            lanes=tuple(w.lane for w in plan.lanes), prefill=tuple(w.prefill for w in plan.lanes),
            tiles=tuple(plan_attention(spans, total_rows=padded, group=group, page_size=p, device=self.device,
                                       dtype=self.dtype)) if self.model.attention_tiles else (),
            images=tuple(self._images(plan, spans)), max_position=max(positions, default=0))

    def _check_work(self, w: LaneWork, seen: set[int]) -> None:
        self._check_lane(w.lane)
        if w.lane in seen:
            raise ValueError(f"lane {w.lane} appears twice in one round")
        seen.add(w.lane)
        if not w.tokens or w.start < 0:
            raise ValueError(f"lane {w.lane}: empty work or negative start {w.start}")
        end = w.start + len(w.tokens)
        if end > self.info.max_context:  # (the rope table never grows under a captured program)
            raise ValueError(f"lane {w.lane}: row {end - 1} past the model's max_context {self.info.max_context}")
        if len(w.page_table) * self.info.page_size < end:
            raise ValueError(f"lane {w.lane}: {len(w.page_table)} pages cannot hold row {end - 1}")
        for r in (*w.sample_rows, *w.logits_rows, *w.digest_rows):
            if not 0 <= r < len(w.tokens):
                raise ValueError(f"lane {w.lane}: row {r} outside its {len(w.tokens)} rows")
        if w.drafts and (w.sample_rows != tuple(range(len(w.tokens))) or len(w.tokens) != len(w.drafts) + 1):
            raise ValueError(f"lane {w.lane}: verify rows must be 1 + {len(w.drafts)} rows, each sampled")

    def _images(self, plan: RoundPlan, spans: list[AttentionSpan]):
        """(round row indices, fp32 rows) for image rows overlapping this round's rows."""
        for w, span in zip(plan.lanes, spans):
            for image in w.images:
                at = image.identity.at
                lo, hi = max(at, w.start), min(at + image.identity.tokens, w.start + len(w.tokens))
                if lo >= hi:
                    continue
                # a copy of the rows used: a memfd payload's array may be read-only
                rows = torch.tensor(np.asarray(image.rows, dtype=np.float32)[lo - at : hi - at])
                idx = torch.arange(span.row + lo - w.start, span.row + hi - w.start, device=self.device)
                yield idx, rows.to(self.device)

    def _wanted_rows(self, plan: RoundPlan, first_rows: Sequence[int]) -> tuple[list[int], dict]:
        """Round rows that need logits (lane i's rows start at first_rows[i]), and (lane, row) ->
        index into them."""
        where: dict[tuple[int, int], int] = {}
        rows: list[int] = []
        for w, first in zip(plan.lanes, first_rows):
            for r in sorted({*w.sample_rows, *w.logits_rows, *w.digest_rows}):
                where[(w.lane, r)] = len(rows)
                rows.append(first + r)
        return rows, where

    def _long(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _image_error(self, w: LaneWork) -> str | None:
        """Why the lane's image rows cannot enter the forward, or None."""
        for image in w.images:
            shape = np.shape(image.rows)
            if shape != (image.identity.tokens, self.config.hidden_size):
                return (f"image at row {image.identity.at}: rows of shape {tuple(shape)}, the model needs "
                        f"({image.identity.tokens}, {self.config.hidden_size})")
        return None

    def _lane_result(self, w: LaneWork, logits: torch.Tensor | None, where: dict,
                     finite: list[bool], greedy: list[int] | None = None) -> LaneResult:
        """The lane's sampled tokens and logits rows, or its error when a row it samples from or
        returns is not finite, or its sampler fails. `greedy`: each row's greedy pick, made
        elsewhere, which a `greedy_alone` sampler takes in place of reading the row."""
        bad = [r for r in sorted({*w.sample_rows, *w.logits_rows, *w.digest_rows}) if not finite[where[(w.lane, r)]]]
        if bad:
            return LaneResult(w.lane, error=f"the logits row at position {w.start + bad[0]} is not "
                                            "finite (NaN or inf)")
        sampler = self._sampler(w.lane) if w.sample_rows else None
        picked = greedy is not None and sampler is not None and sampler.greedy_alone
        sampled, logprobs = [], []
        try:
            for i, r in enumerate(w.sample_rows):
                row = where[(w.lane, r)]
                sampled.append(sampler.take_pick(greedy[row]) if picked else sampler.sample(logits[row], w.start + r + 1))
                logprobs.append(sampler.last_logprob)
                if w.drafts and (i == len(w.drafts) or sampled[-1] != w.drafts[i]):
                    break  # verify rows: only up to the first rejected draft (LaneSampler.verify)
        except _DEVICE_ERRORS:
            raise
        except _LANE_ERRORS as e:
            return LaneResult(w.lane, error=f"sampling failed: {e}")
        if w.drafts and len(sampled) < len(w.tokens):
            self._rollback(w.lane, len(sampled))  # the copy may still be in flight: later steps wait
        rows = None
        if w.logits_rows:
            idx = torch.tensor([where[(w.lane, r)] for r in w.logits_rows], device=self.device)
            rows = logits.index_select(0, idx)
        digests = ()
        if w.digest_rows:
            digests = logits_sha256(logits.index_select(0, torch.tensor([where[(w.lane, r)] for r in w.digest_rows],
                                                                        device=self.device)))
        wants = sampler is not None and sampler.params.logprobs is not None
        return LaneResult(lane=w.lane, sampled=tuple(sampled), logits=rows, digests=digests,
                          logprobs=tuple(logprobs) if wants else None)


def _finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each logits row is finite. A row's sum is finite only when all its values are (an
    inf or NaN makes it inf or NaN), so one vectorized sum settles the usual round; only when
    some sum is not finite (a bad row, or finite values whose sum overflows) are rows checked
    one value at a time."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:  # numpy: three torch ops fewer a round
        with np.errstate(over="ignore", invalid="ignore"):  # an inf or NaN sum is the answer, not a warning
            finite = bool(np.isfinite(logits.numpy().sum(axis=1)).all())
    else:
        finite = bool(torch.isfinite(logits.sum(dim=1)).all())
    if finite:
        return [True] * logits.shape[0]
    return torch.isfinite(logits).all(dim=1).tolist()


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in host memory, as a flat byte view (no copy on CPU beyond contiguity)."""
    t = t.detach().contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).cpu().numpy())
