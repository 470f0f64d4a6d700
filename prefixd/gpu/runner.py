"""ModelRunner: the torch implementation of `prefixd.scheduler.device.Device`.

One `run_round` is one batched forward: the plan's lanes are concatenated into one row
batch, every row's K/V goes into its lane's pages, attention reads only through each
lane's page table, and the lm_head runs only on rows that are sampled or returned.

A failure that belongs to one lane ends that lane alone (`LaneResult.error`): image rows of the
wrong shape keep the lane out of the forward; a non-finite logits row or a sampler error is
found per lane after it. Other lanes' rows never read the failed lane's (attention reads only
through each lane's page table), so their bits are unchanged. A failure of the forward itself
raises: the device, not one lane, failed.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from prefixd.gpu.attention import AttentionSpan, plan_attention
from prefixd.gpu.constrain import GrammarMask
from prefixd.gpu.copy import CopyEngine
from prefixd.gpu.families import build_family
from prefixd.gpu.kv_pool import KVPool
from prefixd.gpu.model import RoundInputs
from prefixd.gpu.sampling import LaneSampler
from prefixd.scheduler.device import DeviceInfo
from prefixd.gpu.families.qwen3_5_state import HybridState
from prefixd.scheduler.records import (DiskLoad, LaneResult, LaneWork, PagePayload, RoundPlan, RoundResult,
                                       SamplingParams, TokenLogprob)
from prefixd.text.grammar import ll_tokenizer

# Errors a lane's sampler may raise on its own row; device-wide ones (a CUDA fault, no memory)
# are re-raised so that the round fails as a whole.
_LANE_ERRORS = (RuntimeError, ValueError, ArithmeticError)
_DEVICE_ERRORS = (torch.AcceleratorError, torch.OutOfMemoryError)


class ModelRunner:
    """Runs rounds for `num_lanes` lanes over a pool of `num_pages` KV pages."""

    def __init__(self, checkpoint: Any, *, device: torch.device, dtype: torch.dtype, num_lanes: int,
                 num_pages: int, page_size: int = 16, mode: str = "invariant") -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.mode = mode
        self.tokenizer = checkpoint.tokenizer
        self.config = config = checkpoint.config
        self.model = build_family(checkpoint, self.device, dtype, mode)
        self.model.new_lane_states(num_lanes)
        self.kv = KVPool(num_layers=self.model.num_kv_layers, num_pages=num_pages, page_size=page_size,
                         num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                         device=self.device, dtype=dtype)
        self.info = DeviceInfo(
            num_lanes=num_lanes, num_pages=num_pages, page_size=page_size,
            max_context=config.max_context, vocab_size=config.vocab_size,
            kv_bytes_per_page=self.kv.bytes_per_page, lane_state_bytes=self.model.lane_state_bytes,
            logits_row_bytes=4 * config.vocab_size, weights_bytes=int(checkpoint.weights_bytes),
            workspace_bytes_per_row=self.model.workspace_bytes_per_row,
            invariant_rows=self.model.invariant_rows)
        self.copies = CopyEngine(self.device)  # page and state copies, fenced
        self._samplers: dict[int, LaneSampler] = {}
        self._ll_tokenizer: Any = None

    # Device protocol -------------------------------------------------------------------
    def start_stream(self, lane: int, sampling: SamplingParams, history: Sequence[int]) -> None:
        self._check_lane(lane)
        vocab = self.tokenizer.vocab_size if self.tokenizer is not None else self.config.vocab_size
        self._samplers[lane] = LaneSampler(sampling, history, vocab_size=self.config.vocab_size,
                                           tokenizer_vocab=min(vocab, self.config.vocab_size),
                                           device=self.device, constraint=self._constraint(sampling))

    def _constraint(self, sampling: SamplingParams) -> GrammarMask | None:
        if sampling.grammar is None:
            return None
        if self._ll_tokenizer is None:  # built on first use: ~1 s for a large vocabulary
            self._ll_tokenizer = ll_tokenizer(self.tokenizer)
        return GrammarMask(self._ll_tokenizer, sampling.grammar, vocab_size=self.config.vocab_size,
                           background=self.device.type != "cpu")  # on the CPU the forward wants every core

    def run_round(self, plan: RoundPlan) -> RoundResult:
        refused = {w.lane: err for w in plan.lanes if (err := self._image_error(w)) is not None}
        runnable = tuple(w for w in plan.lanes if w.lane not in refused)
        if not runnable:
            return RoundResult(lanes=tuple(LaneResult(lane, error=err) for lane, err in refused.items()))
        self.copies.wait_all()  # a round must not read pages a copy is still writing
        with torch.inference_mode():
            run = RoundPlan(runnable)
            inputs = self._inputs(run)
            t0 = time.perf_counter()
            hidden = self.model.forward(inputs, self.kv)
            wanted, where = self._wanted_rows(run, inputs)
            logits = self.model.logits(hidden.index_select(0, wanted)) if where else None
            finite = torch.isfinite(logits).all(dim=1).tolist() if logits is not None else []
            forward_s = time.perf_counter() - t0
            results = {w.lane: self._lane_result(w, logits, where, finite) for w in runnable}
        results.update((lane, LaneResult(lane, error=err)) for lane, err in refused.items())
        return RoundResult(lanes=tuple(results[w.lane] for w in plan.lanes), forward_s=forward_s)

    def sample(self, lane: int, logits: torch.Tensor, row: int = 0) -> int:
        sampler = self._sampler(lane)  # a stored row: the stream's first token
        return sampler.sample(logits[row], sampler.first_position)

    def last_logprob(self, lane: int) -> TokenLogprob | None:
        return self._sampler(lane).last_logprob

    def capture(self, lane: int) -> Any:
        self._check_lane(lane)
        self.copies.wait_all()
        return self.model.capture(lane)

    def restore(self, lane: int, state: Any) -> int:
        self._check_lane(lane)
        self.copies.wait_all()
        return self.model.restore(lane, state)

    def reset_lane(self, lane: int) -> None:
        self._check_lane(lane)
        self.copies.wait_all()
        self.model.reset(lane)

    def rollback(self, lane: int, num_rows: int) -> int:
        """Keep the first `num_rows` rows of the lane's last multi-row decode (a rejected draft
        tail). KV rows past them are simply overwritten later; a family with lane state restores
        it from its per-row record. The copy is issued on the copy engine and may still be in
        flight on return: every later round, capture, restore and reset waits for it.
        Returns bytes copied (0 for attention-only families)."""
        self._check_lane(lane)
        rollback_copy = getattr(self.model, "rollback_copy", None)
        if rollback_copy is None:
            return 0
        src, dst = rollback_copy(lane, num_rows)
        return self.copies.scatter([src], [dst]).nbytes

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> int:
        """Copy pages of every attention layer through the copy engine; waits for it."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} sources for {len(dst)} destinations")
        if not src:
            return 0
        self.copies.copy_pages(self.kv.pools(), src, dst).wait()
        return len(src) * self.kv.bytes_per_page

    def export_pages(self, pages: Sequence[int], state: Any, logits: torch.Tensor | None) -> PagePayload:
        """Host copies for the disk tier: the pages page-major (n, 2, layers, P, kv_heads, head_dim), the lane state's bytes and the float32 logits rows. Runs on the engine
        thread; the writer thread only reads the returned buffers."""
        self.copies.wait_all()
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        # page-major (n, 2, L, P, H, D), one gather: a file's leading pages are a byte prefix
        kv = self.kv.storage.permute(2, 0, 1, 3, 4, 5).index_select(0, idx)
        return PagePayload(kv=_host_bytes(kv), state=None if state is None else _host_bytes(state.data),
                           logits=None if logits is None else _host_bytes(logits))

    def load_pages(self, load: DiskLoad) -> tuple[Any, torch.Tensor | None]:
        """Write the load's page bytes into their pages (one copy from the read buffer into the
        pool); the state and logits row come back as device tensors made from the bytes."""
        self.copies.wait_all()
        shape = self.kv.storage.shape  # (2, L, num_pages, P, H, D)
        for pl in load.pages:
            if not pl.pages:
                continue
            src = torch.frombuffer(pl.kv, dtype=torch.uint8).view(self.dtype)
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
        return state, logits

    def kv_rows(self, layer: int, page_table: Sequence[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (n, kv_heads, head_dim) of attention layer `layer`, for tests."""
        return self.kv.rows(layer, page_table, n)

    # Round assembly ---------------------------------------------------------------------
    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane < self.info.num_lanes:
            raise ValueError(f"lane {lane} outside [0, {self.info.num_lanes})")

    def _sampler(self, lane: int) -> LaneSampler:
        if lane not in self._samplers:
            raise RuntimeError(f"lane {lane} samples before start_stream")
        return self._samplers[lane]

    def _inputs(self, plan: RoundPlan) -> RoundInputs:
        p = self.info.page_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans = []
        seen = set()
        for w in plan.lanes:
            self._check_work(w, seen)
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
            tiles=tuple(plan_attention(spans, total_rows=padded, group=group, page_size=p,
                                       device=self.device, dtype=self.dtype)),
            images=tuple(self._images(plan, spans)))

    def _check_work(self, w: LaneWork, seen: set[int]) -> None:
        self._check_lane(w.lane)
        if w.lane in seen:
            raise ValueError(f"lane {w.lane} appears twice in one round")
        seen.add(w.lane)
        if not w.tokens or w.start < 0:
            raise ValueError(f"lane {w.lane}: empty work or negative start {w.start}")
        end = w.start + len(w.tokens)
        if len(w.page_table) * self.info.page_size < end:
            raise ValueError(f"lane {w.lane}: {len(w.page_table)} pages cannot hold row {end - 1}")
        if any(not 0 <= pg < self.info.num_pages for pg in w.page_table):
            raise ValueError(f"lane {w.lane}: page id outside [0, {self.info.num_pages})")
        if any(not 0 <= t < self.config.vocab_size for t in w.tokens):
            raise ValueError(f"lane {w.lane}: token id outside [0, {self.config.vocab_size})")
        for r in (*w.sample_rows, *w.logits_rows):
            if not 0 <= r < len(w.tokens):
                raise ValueError(f"lane {w.lane}: row {r} outside its {len(w.tokens)} rows")

    def _images(self, plan: RoundPlan, spans: list[AttentionSpan]):
        """(round row indices, fp32 rows) for image rows overlapping this round's rows."""
        for w, span in zip(plan.lanes, spans):
            for image in w.images:
                at = image.identity.at
                lo, hi = max(at, w.start), min(at + image.identity.tokens, w.start + len(w.tokens))
                if lo >= hi:
                    continue
                rows = torch.as_tensor(np.asarray(image.rows, dtype=np.float32))
                idx = torch.arange(span.row + lo - w.start, span.row + hi - w.start, device=self.device)
                yield idx, rows[lo - at : hi - at].to(self.device)

    def _wanted_rows(self, plan: RoundPlan, inputs: RoundInputs) -> tuple[torch.Tensor, dict]:
        """Round rows that need logits, and (lane, row) -> index into them."""
        where: dict[tuple[int, int], int] = {}
        rows: list[int] = []
        for w, span in zip(plan.lanes, inputs.spans):
            for r in sorted(set(w.sample_rows) | set(w.logits_rows)):
                where[(w.lane, r)] = len(rows)
                rows.append(span.row + r)
        return torch.tensor(rows, dtype=torch.long, device=self.device), where

    def _image_error(self, w: LaneWork) -> str | None:
        """Why the lane's image rows cannot enter the forward, or None."""
        for image in w.images:
            shape = np.shape(image.rows)
            if shape != (image.identity.tokens, self.config.hidden_size):
                return (f"image at row {image.identity.at}: rows of shape {tuple(shape)}, the model needs "
                        f"({image.identity.tokens}, {self.config.hidden_size})")
        return None

    def _lane_result(self, w: LaneWork, logits: torch.Tensor | None, where: dict,
                     finite: list[bool]) -> LaneResult:
        """The lane's sampled tokens and logits rows, or its error when a row it samples from or
        returns is not finite, or its sampler fails."""
        bad = [r for r in sorted(set(w.sample_rows) | set(w.logits_rows)) if not finite[where[(w.lane, r)]]]
        if bad:
            return LaneResult(w.lane, error=f"the logits row at position {w.start + bad[0]} is not "
                                            "finite (NaN or inf)")
        if w.drafts and (w.sample_rows != tuple(range(len(w.tokens))) or len(w.tokens) != len(w.drafts) + 1):
            raise ValueError(f"lane {w.lane}: verify rows must be 1 + {len(w.drafts)} rows, each sampled")
        sampler = self._sampler(w.lane) if w.sample_rows else None
        sampled, logprobs = [], []
        try:
            for i, r in enumerate(w.sample_rows):
                sampled.append(sampler.sample(logits[where[(w.lane, r)]], w.start + r + 1))
                logprobs.append(sampler.last_logprob)
                if w.drafts and (i == len(w.drafts) or sampled[-1] != w.drafts[i]):
                    break  # verify rows: only up to the first rejected draft (LaneSampler.verify)
        except _DEVICE_ERRORS:
            raise
        except _LANE_ERRORS as e:
            return LaneResult(w.lane, error=f"sampling failed: {e}")
        if w.drafts and len(sampled) < len(w.tokens):
            self.rollback(w.lane, len(sampled))  # the copy may still be in flight: later steps wait
        rows = None
        if w.logits_rows:
            idx = torch.tensor([where[(w.lane, r)] for r in w.logits_rows], device=self.device)
            rows = logits.index_select(0, idx)
        wants = sampler is not None and sampler.params.logprobs is not None
        return LaneResult(lane=w.lane, sampled=tuple(sampled), logits=rows,
                          logprobs=tuple(logprobs) if wants else None)


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in host memory, as a flat byte view (no copy on CPU beyond contiguity)."""
    t = t.detach().contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).cpu().numpy())
