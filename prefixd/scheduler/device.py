"""The narrow interface between the scheduler and the model device.

`gpu.runner.ModelRunner` implements it with torch; `tests/scheduler/fake_device.py`
implements it in plain Python so scheduler and store tests run in microseconds.
Page ids are owned by the scheduler (`scheduler.pages.PageAllocator`); the device only
holds the KV pool they index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from prefixd.scheduler.records import RoundPlan, RoundResult


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
        """Run `plan`: its disk loads and exports, resets, restores and page copies, sampler
        set-up and stored-row samples, then one batched forward (writing every row's KV into
        its lane's pages, advancing every planned lane's recurrent state, sampling where asked,
        rolling a rejected verify's lane back), then its captures. Returns tokens, logits rows
        and digests, captured states and the exports' host bytes."""

    def close(self) -> None:
        """Release device resources; no round runs after it."""
