"""The narrow interface between the scheduler and the model device.

`gpu.runner.ModelRunner` implements it with torch; `tests/scheduler/fake_device.py`
implements it in plain Python so scheduler and store tests run in microseconds.
Page ids are owned by the scheduler (`scheduler.pages.PageAllocator`); the device only
holds the KV pool they index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from prefixd.scheduler.records import (DeviceRows, DeviceState, DiskLoad, PagePayload, RoundPlan, RoundResult,
                                       SamplingParams, TokenLogprob)


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Static facts the scheduler plans with."""

    num_lanes: int
    num_pages: int
    page_size: int
    max_context: int
    vocab_size: int
    kv_bytes_per_page: int  # all attention layers, K and V
    lane_state_bytes: int  # recurrent/conv state held per lane (0 for attention-only)
    logits_row_bytes: int  # one float32 logits row
    weights_bytes: int
    workspace_bytes_per_row: int  # activations per prefill row in flight
    invariant_rows: bool  # True: every row is row-invariant (any identity-equal row resumes)
    lookahead: int = 0  # tokens past a page whose ids key its last row (MTP heads); 0 here


class Device(Protocol):
    info: DeviceInfo

    def start_stream(self, lane: int, sampling: SamplingParams, history: Sequence[int]) -> None:
        """Bind sampling state (per-lane generator seeded from `sampling.seed`, repetition
        history = `history`) to `lane`. Does not touch KV or recurrent state."""

    def run_round(self, plan: RoundPlan) -> RoundResult:
        """Run one batched forward; writes KV of every row into its lane's pages, advances
        recurrent state of every lane in the plan, samples where asked."""

    def sample(self, lane: int, logits: DeviceRows, row: int = 0) -> int:
        """Sample one token for `lane` from a stored logits row (a full cache hit: no forward)."""

    def last_logprob(self, lane: int) -> TokenLogprob | None:
        """The logprobs of the token `lane` sampled last, when its sampling asks for them."""

    def capture(self, lane: int) -> DeviceState:
        """Copy the lane's non-page state (waits for in-flight copies first)."""

    def restore(self, lane: int, state: DeviceState) -> int:
        """Overwrite the lane's non-page state with `state`; returns bytes copied."""

    def reset_lane(self, lane: int) -> None:
        """Zero the lane's non-page state (waits for in-flight copies first)."""

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> int:
        """Copy KV pages src[i] -> dst[i] (copy-on-write of a partial page); returns bytes."""

    def export_pages(self, pages: Sequence[int], state: DeviceState | None,
                     logits: DeviceRows | None) -> PagePayload:
        """Host copies of `pages` (every attention layer, K and V, in page order), of `state`
        and of `logits`, for the disk tier's writer thread (which runs no device code)."""

    def load_pages(self, load: DiskLoad) -> tuple[DeviceState | None, DeviceRows | None]:
        """Write each load's bytes into its pages; returns the state and logits row made from
        the load's bytes (None where it has none)."""
