"""Per-lane recurrent + conv state of the hybrid family, and the decode rollback record.

Each lane owns one contiguous byte row, so a snapshot is a single copy:

    lane row: | rec L0 | rec L1 | ... | conv L0 | conv L1 | ... | carry |
    rec  Li: (Hv, dk, dv) float32      the Gated DeltaNet state of linear layer i
    conv Li: (K-1, conv_dim) dtype     the last K-1 conv inputs of linear layer i
    carry:   (hidden,) float32         the MTP draft carry: the final-normed hidden row of
                                       the lane's last row (only with an MTP head)

Segments start on 16-byte boundaries; `lane_state_bytes` is the row length, padding included.
The same layout is used for the rollback record: row j holds the state after decode row j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixd.gpu.families.qwen3_5_config import HybridConfig

_ALIGN = 16


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class HybridState:
    """A captured lane state: one uint8 tensor of `lane_state_bytes` (a DeviceState)."""

    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


class StateViews:
    """Typed views into a (rows, lane_state_bytes) uint8 buffer: rec[slot], conv[slot]."""

    def __init__(self, buf: torch.Tensor, layout: "StateLayout") -> None:
        self.buf = buf
        rows = buf.shape[0]
        self.rec: list[torch.Tensor] = []
        self.conv: list[torch.Tensor] = []
        for off in layout.rec_offsets:
            raw = buf[:, off:off + layout.rec_bytes].view(torch.float32)
            self.rec.append(raw.view(rows, *layout.rec_shape))  # (rows, Hv, dk, dv)
        for off in layout.conv_offsets:
            raw = buf[:, off:off + layout.conv_bytes].view(layout.conv_dtype)
            self.conv.append(raw.view(rows, *layout.conv_shape))  # (rows, K-1, C)
        self.carry: torch.Tensor | None = None  # (rows, hidden) float32
        if layout.carry_bytes:
            off = layout.carry_offset
            self.carry = buf[:, off:off + layout.carry_bytes].view(torch.float32)


class StateLayout:
    """Byte offsets of every linear layer's state inside a lane row."""

    def __init__(self, config: HybridConfig, conv_dtype: torch.dtype) -> None:
        c = config
        self.conv_dtype = conv_dtype
        self.rec_shape = (c.lin_num_v_heads, c.lin_k_dim, c.lin_v_dim)
        self.conv_shape = (c.conv_kernel - 1, c.conv_dim)
        self.rec_bytes = 4 * c.lin_num_v_heads * c.lin_k_dim * c.lin_v_dim
        elem = torch.empty((), dtype=conv_dtype).element_size()
        self.conv_bytes = elem * (c.conv_kernel - 1) * c.conv_dim
        num = len(c.linear_layers)
        self.rec_offsets = [i * _aligned(self.rec_bytes) for i in range(num)]
        base = num * _aligned(self.rec_bytes)
        self.conv_offsets = [base + i * _aligned(self.conv_bytes) for i in range(num)]
        self.carry_offset = base + num * _aligned(self.conv_bytes)
        self.carry_bytes = 4 * c.hidden_size if c.num_mtp_layers else 0
        self.lane_state_bytes = self.carry_offset + _aligned(self.carry_bytes)


class LaneStatePool:
    """The live state of every lane, plus each lane's rollback record of its last verify."""

    def __init__(self, config: HybridConfig, num_lanes: int, *, device: torch.device,
                 conv_dtype: torch.dtype) -> None:
        self.layout = StateLayout(config, conv_dtype)
        self.device = device
        self.lane_state_bytes = self.layout.lane_state_bytes
        buf = torch.zeros(num_lanes, self.lane_state_bytes, dtype=torch.uint8, device=device)
        self.live = StateViews(buf, self.layout)
        self._trails: dict[int, StateViews] = {}

    def capture(self, lane: int) -> HybridState:
        """A copy of the lane's state (one contiguous copy)."""
        return HybridState(self.live.buf[lane].clone())

    def restore(self, lane: int, state: HybridState) -> int:
        """Overwrite the lane's state with `state`; returns bytes copied."""
        if state.nbytes != self.lane_state_bytes:
            raise ValueError(f"state of {state.nbytes} bytes, lanes hold {self.lane_state_bytes}")
        self.live.buf[lane].copy_(state.data)
        self._trails.pop(lane, None)
        return self.lane_state_bytes

    def reset(self, lane: int) -> None:
        """Zero the lane's state (a fresh conversation) and drop its rollback record."""
        self.live.buf[lane].zero_()
        self._trails.pop(lane, None)

    def begin_trail(self, lane: int, num_rows: int) -> StateViews:
        """Start the rollback record of a `num_rows`-row decode on `lane`."""
        buf = torch.empty(num_rows, self.lane_state_bytes, dtype=torch.uint8, device=self.device)
        trail = StateViews(buf, self.layout)
        self._trails[lane] = trail
        return trail

    def trail(self, lane: int) -> StateViews:
        """The rollback record being written by the lane's current decode."""
        return self._trails[lane]

    def drop_trail(self, lane: int) -> None:
        self._trails.pop(lane, None)

    def trail_rows(self, lane: int) -> int:
        """Rows in the lane's rollback record (0: none)."""
        trail = self._trails.get(lane)
        return 0 if trail is None else int(trail.buf.shape[0])

    def rollback(self, lane: int, num_rows: int) -> int:
        """Set the lane's state to the state after the first `num_rows` rows of its last
        multi-row decode (1 <= num_rows <= trail rows); returns bytes copied."""
        src, dst = self.rollback_copy(lane, num_rows)
        dst.copy_(src)
        return self.lane_state_bytes

    def rollback_copy(self, lane: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (source, destination) of a rollback, for a caller that issues the copy itself
        (the runner's copy engine); the lane's record is consumed."""
        trail = self._trails.get(lane)
        if trail is None or not 1 <= num_rows <= trail.buf.shape[0]:
            raise ValueError(f"lane {lane}: no rollback record covering {num_rows} rows")
        self._trails.pop(lane)
        return trail.buf[num_rows - 1], self.live.buf[lane]
