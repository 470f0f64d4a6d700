"""Bounds on what clients may hold in the daemon: connections, buffers, queues, deadlines.

One frozen record, built once; docs/protocol.md ("Connection bounds") lists the same numbers.
Tests inject small values; the daemon runs with the defaults, and with the client pacing
(pacing.py) its flags ask for (`for_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixd.front.abandon import AbandonLimits
from prefixd.front.pacing import PaceLimits

# A request body (HTTP) or a read of frames (the socket) this large is parsed and checked on a
# worker thread, not on the event loop, in both fronts: a long agent chat (8,000 messages,
# ~220 KB) costs ~6 ms to decode and check, and on the loop every other client waits that long.
OFF_LOOP_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class ConnectionBounds:
    """Per-daemon and per-connection bounds of the socket front."""

    max_connections: int = 256  # open client connections; one more gets too_many_connections
    max_streams: int = 256  # generates one connection may have in flight
    out_frames: int = 512  # queued outgoing frames; a full queue pauses reading that connection
    send_timeout_s: float = 30.0  # a client that takes no bytes for this long is disconnected
    frame_deadline_s: float = 30.0  # an incomplete frame must complete within this, from its first byte
    max_buffered_bytes: int = 64 << 20  # incomplete frames, all connections together
    off_loop_bytes: int = OFF_LOOP_BYTES  # a read completing this many bytes of frames is decoded on a worker thread
    accept_backoff_s: float = 0.1  # pause after a failed accept (EMFILE...) before trying again
    max_heavy_jobs: int = 1  # heavy renders/encodes running at once (gate.py); one per client
    pace: PaceLimits = field(default_factory=PaceLimits)  # one client's frame budget (pacing.py)
    abandon: AbandonLimits = field(default_factory=AbandonLimits)  # holds for abandoned generates (abandon.py)

    @classmethod
    def for_config(cls, cfg: Any) -> ConnectionBounds:
        """The defaults, with the pacing (rate 0: no pacing) and abandon holds (0: none) a
        DaemonConfig's flags set."""
        return cls(pace=PaceLimits(rate=cfg.client_frame_rate or None, burst=cfg.client_frame_burst,
                                   error_cost=cfg.error_frame_cost, connect_cost=cfg.connect_frame_cost),
                   abandon=AbandonLimits(grace=cfg.abandon_grace, hold_max_s=cfg.abandon_hold_max_s))

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_streams, self.out_frames, self.max_buffered_bytes,
               self.off_loop_bytes, self.max_heavy_jobs) < 1:
            raise ValueError(f"connection bounds must be positive: {self}")
        if min(self.send_timeout_s, self.frame_deadline_s, self.accept_backoff_s) <= 0:
            raise ValueError(f"connection timeouts must be positive: {self}")
