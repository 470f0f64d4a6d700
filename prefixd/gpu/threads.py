"""The engine's CPU thread policy on a shared machine: use only the cores others leave free.

torch's CPU ops split each op across an OpenMP team. When another process keeps a core
busy, a team as wide as the machine waits at every op's barrier for the member the kernel
has descheduled (and its spinning members take time from that process too). So
`CpuThreads.tick()`, called where the engine process runs its rounds, before each, re-reads the CPU time
other processes used over the last `interval_s` (from /proc/stat minus this process) and
sets torch's thread count to the cores they leave free, between 1 and `max_threads`. A team
of one has no barrier to wait at. (OMP_WAIT_POLICY=PASSIVE instead halves prefill on an
idle machine: every op then wakes sleeping workers; docs/runtime.md.)

A measurement covers the time since the last one, and the engine measures only when it runs
rounds: after it waited idle, the window holds mostly others' past (a build that has ended,
or the run before this one), so the next measurement comes after `FRESH_S` instead of a full
interval, and the count follows the present within a tenth of a second.

A thread count never changes a row's bits (tests/gpu/test_threads.py), so switching between
rounds keeps every exactness rule. torch keeps the count per thread: `tick` must run on the
thread that runs the rounds. This module imports torch only when a count is set.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEFAULT_INTERVAL_S = 1.0
FRESH_S = 0.1  # the next measurement after a window over 1.5 intervals (the engine waited idle)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds: busy over all cores, and this process's own."""

    busy_s: float
    own_s: float
    wall_s: float


def read_sample(stat_path: Path = Path("/proc/stat"), cores: frozenset[int] | None = None,
                also_own: tuple[int, ...] = ()) -> CpuSample | None:
    """Now's cumulative busy seconds over `cores` (default: this process's affinity) and its
    own CPU seconds, with those of the processes `also_own` (the daemon's front process: its
    work is the daemon's own, not another program's); None where /proc/stat cannot be read."""
    cores = usable_cores() if cores is None else cores
    try:
        lines = stat_path.read_text().splitlines()
    except OSError:
        return None
    busy_ticks = 0
    for line in lines:
        fields = line.split()
        if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
            continue
        if int(fields[0][3:]) in cores:
            # user nice system idle iowait irq softirq steal: busy is all but idle and iowait
            values = [int(v) for v in fields[1:9]]
            busy_ticks += sum(values) - values[3] - values[4]
    times = os.times()
    own_s = times.user + times.system + sum(process_cpu_s(pid) for pid in also_own)
    return CpuSample(busy_s=busy_ticks / os.sysconf("SC_CLK_TCK"), own_s=own_s, wall_s=time.monotonic())


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def usable_cores() -> frozenset[int]:
    """The cores this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def free_cores(before: CpuSample, after: CpuSample, num_cores: int) -> float:
    """Cores other processes left idle between two samples (0..num_cores)."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return float(num_cores)
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return min(float(num_cores), max(0.0, num_cores - others / wall))


def threads_for(free: float, max_threads: int) -> int:
    """Threads to run beside other processes: the free cores, rounded, at least one.

    A core counts as free when other processes used less than half of it.
    """
    return max(1, min(max_threads, int(free + 0.5)))


class CpuThreads:
    """Adapts torch's intra-op thread count to the cores other processes leave free (the
    processes named in `read_sample`'s `also_own`, such as the daemon's front, count as its own).

    `tick()` may change the calling thread's torch thread count; it returns the count in use.
    It measures every `interval_s`, and `FRESH_S` after a window that spanned an idle wait.
    Between measurements a tick reads only `clock`: a sample reads /proc/stat and the front's
    /proc/PID/stat (40-70 µs on an idle machine, more on a busy one), too much for every round.
    `sample`, `clock` and `set_threads` are injectable for tests.
    """

    def __init__(self, max_threads: int, *, interval_s: float = DEFAULT_INTERVAL_S,
                 num_cores: int | None = None,
                 sample: Callable[[], CpuSample | None] = read_sample,
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] | None = None) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads {max_threads}: needs at least 1")
        self.max_threads = max_threads
        self.interval_s = interval_s
        self.num_cores = num_cores or len(usable_cores())
        self._sample = sample
        self._clock = clock
        self._set_threads = set_threads or _torch_set_threads
        self._last = sample()
        self._due = clock() + interval_s  # the next measurement
        self.threads = max_threads
        self._applied: int | None = None

    @classmethod
    def up_to_current(cls, also_own: tuple[int, ...] = ()) -> CpuThreads:
        """A policy that never goes above torch's thread count now (OMP_NUM_THREADS, or the
        cores); `also_own`: processes whose CPU counts as the daemon's own (read_sample)."""
        import torch

        return cls(max_threads=torch.get_num_threads(), sample=lambda: read_sample(also_own=also_own))

    def tick(self) -> int:
        """Re-measure when `interval_s` has passed; apply the count if it changed."""
        if self._clock() >= self._due:
            now = self._sample()
            wait = self.interval_s
            if now is not None and self._last is not None:
                self.threads = threads_for(free_cores(self._last, now, self.num_cores), self.max_threads)
                if now.wall_s - self._last.wall_s > 1.5 * self.interval_s:
                    wait = min(FRESH_S, self.interval_s)  # a stale window: look again soon
            self._last = now
            self._due = self._clock() + wait
        threads = self.threads
        if threads != self._applied:
            self._set_threads(threads)
            self._applied = threads
        return threads


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
