"""Decode rounds as fixed programs: the same ops on the same shapes every round, so that on
CUDA each is captured once as a graph and replayed.

A round whose lanes each bring at most `attention.DECODE_ROWS` rows (decode rows, a drafting
lane's verify rows) runs in a *bucket* of (lanes, rows per lane, context): lane i of the round
takes rows [i * rows, (i + 1) * rows) of the bucket, what the round does not fill is padding,
and every lane's keys are read up to the bucket's context (`BUCKET_CONTEXTS`, capped at the
model's max_context: a short conversation does not pay for the longest). With the flash
kernel (CUDA) a lane's keys are read up to its own end whatever the bucket, so there is one
context, max_context: a third of the graphs to capture.
Everything the forward reads about the round lives in buffers of the bucket's fixed size:

    tokens, positions   padding rows: token 0 at position 0
    KV slots            padding rows write one scratch page no lane ever owns
    one attention tile  every lane over every key block up to the bucket's context, its
                        page table padded as `attention._tile` pads it; padding lanes read
                        the scratch page; the mask is computed inside the program from the
                        rows' positions

A row's bits do not depend on the bucket: a key block past a row's position is fully masked
and adds exact zeros (attention.py), the products are row-invariant (linear.py, kernels.py),
and a padding row or lane shares no arithmetic with a real one. So a program's rows equal
the eager round's, bit for bit (tests/gpu/test_programs.py, at every bucket).

A family with lane state (the hybrid) reads each row's lane from `RoundInputs.lane_index`,
padding rows stepping a scratch lane; it takes only rows it computes the same way in a round
of any size (`program_rows`, `program_prefill` on the model: the hybrid, one decode row a lane).

`ModelRunner(programs=...)`: "auto" runs programs where they pay, on CUDA in mode invariant,
captured as CUDA graphs at start-up (progress on stderr, the time reported); "eager" runs the
same programs without capture (the CPU tests); "off" never.
The rope table is grown to max_context first, so no program ever reads a position the host
must check, and no table moves under a captured graph.

One program runs at a time and its outputs are read before the next runs: the graphs share
one memory pool.
"""

from __future__ import annotations

import sys
import time
from typing import Sequence

import numpy as np
import torch

from prefixd.gpu import kernels
from prefixd.gpu.attention import DECODE_ROWS, AttentionTile, _padded_rows, block_size, tile_mask
from prefixd.gpu.kv_pool import KVPool
from prefixd.gpu.model import RoundInputs
from prefixd.scheduler.records import LaneWork

BUCKET_LANES = (1, 2, 4, 8, 16, 32)
BUCKET_ROWS = tuple(r for r in (1, 2, 4, 8) if r <= DECODE_ROWS)  # rows per lane: decode, verify
BUCKET_CONTEXTS = (2048, 8192, 32768)  # keys a lane may read; the model's max_context caps them
# a bucket whose attention scores (bf16) and probabilities (fp32) of one layer would take more
# is not built: its rounds run eagerly
MAX_ATTENTION_BYTES = 1 << 30


def bucket_of(counts: Sequence[int], ends: Sequence[int], lanes: Sequence[int] = BUCKET_LANES,
              rows: Sequence[int] = BUCKET_ROWS,
              contexts: Sequence[int] = BUCKET_CONTEXTS) -> tuple[int, int, int] | None:
    """The smallest (lanes, rows per lane, context) bucket holding lanes of these row counts
    whose last rows end at `ends` (keys read), or None."""
    if not counts:
        return None
    fit_lanes = [n for n in lanes if n >= len(counts)]
    fit_rows = [r for r in rows if r >= max(counts)]
    fit_contexts = [c for c in contexts if c >= max(ends)]
    if not fit_lanes or not fit_rows or not fit_contexts:
        return None
    return fit_lanes[0], fit_rows[0], fit_contexts[0]


def bucket_contexts(max_context: int) -> tuple[int, ...]:
    """BUCKET_CONTEXTS below the model's max_context, then max_context itself."""
    return tuple(c for c in BUCKET_CONTEXTS if c < max_context) + (max_context,)


class DecodeProgram:
    """One bucket's program over a model's forward and logits."""

    def __init__(self, model, kv: KVPool, *, lanes: int, rows: int, context: int, scratch_page: int,
                 scratch_lane: int) -> None:
        c = model.config
        self.model, self.kv = model, kv
        self.lanes, self.rows, self.context = lanes, rows, context
        self.scratch_page, self.scratch_lane = scratch_page, scratch_lane
        device = kv.storage.device
        page = kv.page_size
        self.block = block_size(page)
        self.num_blocks = -(-context // self.block)
        self.pages_per_lane = self.num_blocks * self.block // page
        self.group = c.num_heads // c.num_kv_heads
        self.flash = kernels.triton_path(device)  # the kernel masks from positions: no mask, no padded rows
        self.tile_rows = rows if self.flash else _padded_rows(rows, self.group, kv.dtype)  # a lane's rows in the tile
        self.num_rows = lanes * rows  # the round's rows; the forward may pad more
        self.padded = model.padded_rows(self.num_rows)
        self.max_position = c.max_context - 1  # the rope table covers every position first
        model.rope.cover(self.max_position)
        # every integer input in one buffer: one copy from the host a round
        sizes = {"tokens": self.padded, "positions": self.padded, "slots": self.num_rows, "lane": self.padded,
                 "q_index": lanes * self.tile_rows, "out_index": lanes * self.tile_rows,
                 "page_index": lanes * self.pages_per_lane, "dead_from": lanes, "qpos": lanes * self.tile_rows}
        self._host = np.zeros(sum(sizes.values()), dtype=np.int64)
        self._ints = torch.zeros(self._host.shape[0], dtype=torch.long, device=device)
        self._at: dict[str, slice] = {}
        at = 0
        for name, n in sizes.items():
            self._at[name] = slice(at, at + n)
            at += n
        view = lambda name: self._ints[self._at[name]]  # noqa: E731
        self.masked = None if self.flash else torch.zeros(
            lanes, self.num_blocks, 1, self.tile_rows * self.group, self.block, dtype=torch.bool, device=device)
        self.tile = AttentionTile(lanes, self.tile_rows, self.num_blocks, view("q_index"), view("out_index"),
                                  view("page_index"), 0, self.masked, view("dead_from"), 0,
                                  qpos=view("qpos") if self.flash else None)
        self.inputs = RoundInputs(tokens=view("tokens"), positions=view("positions"), num_rows=self.num_rows,
                                  slots=view("slots"), spans=(), lanes=(), prefill=(), tiles=(self.tile,),
                                  max_position=self.max_position, lane_index=view("lane"))
        self._before = getattr(model, "before_program", None)  # host bookkeeping of a family with lane state
        self._qpos = view("qpos").view(lanes, self.tile_rows)
        self.logits: torch.Tensor | None = None  # (num_rows, vocab) fp32 after each run
        self.graph = None
        self.load(())  # every lane padding: what warm-up and capture run

    def row(self, lane_index: int, r: int) -> int:
        """The bucket row of row r of the round's lane_index-th lane."""
        return lane_index * self.rows + r

    def load(self, work: Sequence[LaneWork]) -> None:
        """Lay the round's lanes out in the host buffer and copy it to the program's inputs."""
        if len(work) > self.lanes or any(len(w.tokens) > self.rows for w in work):
            raise ValueError(f"a round of {len(work)} lanes does not fit bucket ({self.lanes}, {self.rows}, ...)")
        h, at, page = self._host, self._at, self.kv.page_size
        tokens, positions, slots, lane = h[at["tokens"]], h[at["positions"]], h[at["slots"]], h[at["lane"]]
        q_index, out_index, qpos = h[at["q_index"]], h[at["out_index"]], h[at["qpos"]]
        page_index, dead_from = h[at["page_index"]], h[at["dead_from"]]
        scratch = self.scratch_page * page
        zero_row = self.padded  # the forward's zero q row and scratch output row
        tokens[:] = 0
        positions[:] = 0
        slots[:] = scratch
        lane[:] = self.scratch_lane  # padding rows step a lane state no lane owns
        q_index[:] = zero_row
        out_index[:] = zero_row
        qpos[:] = 0
        dead_from[:] = 0
        page_index[:] = self.scratch_page
        t, ppl = self.tile_rows, self.pages_per_lane
        for i, w in enumerate(work):
            n, first, end = len(w.tokens), i * self.rows, w.start + len(w.tokens)
            if end > self.context:
                raise ValueError(f"lane {w.lane}: row {end - 1} past the bucket's context {self.context}")
            if len(w.page_table) * page < end:
                raise ValueError(f"lane {w.lane}: {len(w.page_table)} pages cannot hold row {end - 1}")
            pos = np.arange(w.start, end, dtype=np.int64)
            table = np.asarray(w.page_table[:ppl], dtype=np.int64)
            tokens[first:first + n] = w.tokens
            positions[first:first + n] = pos
            slots[first:first + n] = table[pos // page] * page + pos % page
            lane[first:first + n] = w.lane
            q_index[i * t:i * t + n] = np.arange(first, first + n)
            out_index[i * t:i * t + n] = np.arange(first, first + n)
            qpos[i * t:i * t + n] = pos
            qpos[i * t + n:(i + 1) * t] = end - 1
            dead_from[i] = end
            page_index[i * ppl:i * ppl + len(table)] = table
            page_index[i * ppl + len(table):(i + 1) * ppl] = table[0]
        self._ints.copy_(torch.from_numpy(h), non_blocking=False)
        if self._before is not None:
            self._before([w.lane for w in work])

    def _run(self) -> torch.Tensor:
        """The program: mask, forward, logits of every bucket row."""
        self.tile.index_cache.clear()  # its rows are recomputed from this round's indices
        if self.masked is not None:
            self.masked.copy_(tile_mask(self._qpos, self.num_blocks, 0, self.block, self.group))
        hidden = self.model.forward(self.inputs, self.kv)
        return self.model.logits(hidden[:self.num_rows])

    def run(self, work: Sequence[LaneWork]) -> torch.Tensor:
        """Load the round and run it (replay the graph when captured): (num_rows, vocab) logits."""
        self.load(work)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._run()
        return self.logits

    def capture(self, pool=None) -> None:
        """Capture the program as a CUDA graph (inputs: every lane padding, which writes only
        the scratch page), after two warm-up runs on a side stream (kernels compiled, the
        allocator settled)."""
        device = self.kv.storage.device
        with torch.cuda.device(device):  # streams and the graph on the pool's device, whatever is current
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits = self._run()
        self.graph = graph


class DecodePrograms:
    """A runner's programs, one per bucket up to its lane count and its model's max_context,
    built on first use (eager) or all at start-up and captured (CUDA)."""

    def __init__(self, model, kv: KVPool, *, num_lanes: int, scratch_page: int, capture: bool) -> None:
        self.model, self.kv, self.scratch_page = model, kv, scratch_page
        self.scratch_lane = num_lanes  # a family with lane state has one more for padding rows
        self.lanes = tuple(sorted({n for n in BUCKET_LANES if n < num_lanes} | {min(num_lanes, BUCKET_LANES[-1])}))
        self.rows = tuple(getattr(model, "program_rows", BUCKET_ROWS))
        self.prefill = bool(getattr(model, "program_prefill", True))
        # the flash kernel reads each lane's keys up to its own end: one context serves all
        flash = kernels.triton_path(kv.storage.device)
        self.contexts = (model.config.max_context,) if flash else bucket_contexts(model.config.max_context)
        self.programs: dict[tuple[int, int, int], DecodeProgram] = {}
        self.captured = capture
        self.startup_s = 0.0
        self.failed: str | None = None  # why capture failed: then every round runs eagerly
        if capture:
            try:
                self._capture_all()
            except (RuntimeError, torch.OutOfMemoryError) as e:
                self.failed = f"{type(e).__name__}: {e}"
                self.programs.clear()
                print(f"prefixd: decode programs not captured ({self.failed}); decode rounds run op by op "
                      "(--cuda-graphs off skips the attempt)", file=sys.stderr, flush=True)

    def status(self) -> dict | None:
        """What `status` reports of the captured programs (`model.cuda_graphs`): how many and
        how long their capture took, or why it failed; None when nothing was captured (eager)."""
        if not self.captured:
            return None
        if self.failed is not None:
            return {"captured": 0, "failed": self.failed}
        return {"captured": len(self.programs), "startup_s": round(self.startup_s, 2)}

    def _fits_memory(self, bucket: tuple[int, int, int]) -> bool:
        """Whether one layer's scores and probabilities of the bucket stay under MAX_ATTENTION_BYTES
        (always, with the flash kernel: it keeps none)."""
        if kernels.triton_path(self.kv.storage.device):
            return True
        c, block = self.model.config, block_size(self.kv.page_size)
        group = c.num_heads // c.num_kv_heads
        lanes, rows, context = bucket
        elements = lanes * -(-context // block) * block * c.num_heads * _padded_rows(rows, group, self.kv.dtype)
        return elements * (2 + 4) <= MAX_ATTENTION_BYTES

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        buckets = [b for b in ((n, r, ctx) for n in self.lanes for r in self.rows for ctx in self.contexts)
                   if self._fits_memory(b)]
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for i, bucket in enumerate(buckets, start=1):
                print(f"prefixd: capturing decode programs {i}/{len(buckets)} "
                      f"(lanes {bucket[0]}, rows {bucket[1]}, context {bucket[2]})", file=sys.stderr, flush=True)
                self._program(bucket).capture(pool)
        torch.cuda.synchronize(self.kv.storage.device)
        self.startup_s = time.perf_counter() - t0
        print(f"prefixd: {len(buckets)} decode programs captured in {self.startup_s:.1f} s", file=sys.stderr,
              flush=True)

    def _program(self, bucket: tuple[int, int, int]) -> DecodeProgram:
        if bucket not in self.programs:
            self.programs[bucket] = DecodeProgram(self.model, self.kv, lanes=bucket[0], rows=bucket[1],
                                                  context=bucket[2], scratch_page=self.scratch_page,
                                                  scratch_lane=self.scratch_lane)
        return self.programs[bucket]

    def pick(self, work: Sequence[LaneWork]) -> DecodeProgram | None:
        """The program for this round's lanes, or None: a lane with more rows than a bucket
        holds, images, more lanes than the largest bucket, or a bucket too large to build."""
        if self.failed is not None or any(w.images for w in work):
            return None
        if not self.prefill and any(w.prefill for w in work):
            return None
        bucket = bucket_of([len(w.tokens) for w in work], [w.start + len(w.tokens) for w in work], self.lanes,
                           self.rows, self.contexts)
        if bucket is None or not self._fits_memory(bucket) or (self.captured and bucket not in self.programs):
            return None
        return self._program(bucket)
