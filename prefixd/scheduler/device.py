"""The narrow interface between the scheduler and the model device.

`gpu.runner.ModelRunner` implements it with torch; `tests/scheduler/fake_device.py`
implements it in plain Python so scheduler and store tests run in microseconds.
Page ids are owned by the scheduler (`scheduler.pages.PageAllocator`); the device only
holds the KV pool they index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from prefixd.scheduler.records import DeviceRows, DeviceState, DiskLoad, PagePayload, RoundPlan, RoundResult


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
    lookahead: int = 0  # tokens past a page whose ids key its last row (1 with a draft head)
    draft_head: bool = False  # the device runs an MTP head: LaneWork.propose gives proposals


class Device(Protocol):
    """A round is the only call: the scheduler hands over a `RoundPlan`, the device runs every
    item in the plan's fixed order and answers with a `RoundResult`."""

    info: DeviceInfo

    def run_round(self, plan: RoundPlan) -> RoundResult:
        """Run `plan`: its fences, rollbacks, resets, restores and page copies, sampler set-up
        and stored-row samples, then one batched forward (writing every row's KV into its
        lane's pages, advancing every planned lane's recurrent state, sampling where asked),
        then its captures. Returns tokens, logits rows and digests, and captured states."""

    def close(self) -> None:
        """Release device resources; no round runs after it."""


class DiskPages(Protocol):
    """The disk tier's page export and load (`prefixd.disk.tier`), called by the tier itself
    outside the round: a write-through reads kept pages, a disk hit writes pages before any
    round reads them. Not yet plan items."""

    def export_pages(self, pages: Sequence[int], state: DeviceState | None,
                     logits: DeviceRows | None) -> PagePayload:
        """Host copies of `pages` (every attention layer, K and V, in page order), of `state`
        and of `logits`, for the disk tier's writer thread (which runs no device code)."""

    def load_pages(self, load: DiskLoad) -> tuple[DeviceState | None, DeviceRows | None]:
        """Write each load's bytes into its pages; returns the state and logits row made from
        the load's bytes (None where it has none)."""
