"""The narrow interfaces between the scheduler and what it drives: the model device and the
tier below the RAM store.

`gpu.runner.ModelRunner` implements `Device` with torch; `tests/scheduler/fake_device.py`
implements it in plain Python so scheduler and store tests run in microseconds.
Page ids are owned by the scheduler (`scheduler.pages.PageAllocator`); the device only
holds the KV pool they index. `disk.tier.DiskTier` implements `LowerTier`; the scheduler
never imports it (the disk package depends on the scheduler, not the reverse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, Sequence

from prefixd.scheduler.records import DiskLoad, PageExport, PagePayload, RoundPlan, RoundResult

if TYPE_CHECKING:
    from prefixd.scheduler.pages import PageAllocator
    from prefixd.scheduler.chunks import Schedule
    from prefixd.scheduler.store import PrefixStore, ReuseKey

TierSource = Literal["disk", "shared"]  # where a `LowerTier.fetch` found the entry: this machine's disk, or the shared store


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


class TierStats(Protocol):
    """A lower tier's counts: a dataclass the engine's status reports field by field."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


class LowerTier(Protocol):
    """A tier below the RAM store, as the engine and the admitter use it. It makes no device
    call: its device work (loads of what it fetched, exports of what it keeps) rides in the
    next round's plan, and it holds the pages of that work until the round lands."""

    @property
    def has_work(self) -> bool:
        """Loads or exports wait for a round (the engine runs one for them even when idle)."""

    def attach(self, *, store: PrefixStore, allocator: PageAllocator) -> None:
        """Wire to the engine's RAM store and page allocator, once, before any round; the
        store's keeps are offered to the tier from then on."""

    def fetch(self, key: ReuseKey, schedule: Schedule, have_rows: int) -> TierSource | None:
        """Publish into the RAM store the deepest entry of `key` deeper than `have_rows`.
        Where it came from when the store now holds it (a lookup will hit it); None changes
        nothing the request can see."""

    def take_work(self) -> tuple[tuple[DiskLoad, ...], tuple[PageExport, ...]]:
        """The loads and exports for the round being planned (the plan's `loads`, `exports`)."""

    def landed(self, exported: Sequence[PagePayload]) -> None:
        """The round that ran `take_work`'s items returned; `exported` answers its exports in
        order. The work's pages are let go."""

    def drop_work(self) -> None:
        """The device failed: forget every load and export not landed and let their pages go."""

    def poll(self) -> None:
        """Take the results of the tier's own background work (cheap; called every step)."""

    def held_pages(self) -> list[int]:
        """Pages held for work not landed, one reference each (for the integrity check)."""

    def stats(self) -> TierStats:
        """The tier's running counts."""
