"""Load progress on stderr: a redrawn bar on a terminal, periodic lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

ProgressFn = Callable[[str, int, int], None]


def stderr_progress(*, interval_s: float = 0.5, stream: TextIO | None = None) -> ProgressFn:
    """A progress(stage, done_bytes, total_bytes) callback writing to stderr.

    It writes at most once per `interval_s` per stage, always at a stage's end.
    """
    out = stream if stream is not None else sys.stderr
    tty = bool(getattr(out, "isatty", lambda: False)())
    last: dict[str, float] = {}
    started: dict[str, float] = {}

    def report(stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        started.setdefault(stage, now)
        finished = done >= total
        if not finished and now - last.get(stage, 0.0) < interval_s:
            return
        last[stage] = now
        frac = done / total if total else 1.0
        mb = f"{done / 1e6:.0f}/{total / 1e6:.0f} MB"
        if tty:
            bar = "#" * int(frac * 30)
            end = f" {now - started[stage]:.1f}s\n" if finished else ""
            out.write(f"\r{stage} [{bar:<30}] {frac:4.0%} {mb}{end}")
        else:
            tail = f" in {now - started[stage]:.1f}s" if finished else ""
            out.write(f"{stage}: {frac:.0%} ({mb}){tail}\n")
        out.flush()

    return report
