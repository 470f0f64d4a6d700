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
rounds. After an idle wait (a tick finds that this process used under half a core since the
round before) that window holds others' past, not the present: the tool an agent ran between
two turns, or the other side of a benchmark. So the first round after a wait takes its count
from the threads runnable on the machine at that instant (/proc/stat's `procs_running`, this
one included), never fewer than the window's; a new window starts there, and the next
measurement comes after `FRESH_S`. A build still running keeps its threads runnable and the
count low; a tool that has finished no longer costs the next turn's prefill a core.

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
FRESH_S = 0.1  # after an idle wait: the next measurement, and the shortest wait that counts as one
# after an idle wait, where others are runnable at once: the waits before each count again (1, 2, 4
# and 8 ms after the first). A client that has just sent requests is runnable for a few ms (eight
# streams on eight connections: up to ~8 ms, docs/benchmarks.md); a build stays runnable.
RECHECK_WAITS_S = (0.001, 0.001, 0.002, 0.004)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds: busy over all cores, and this process's own."""

    busy_s: float
    own_s: float
    wall_s: float
    running: int | None = None  # threads runnable on the machine at the instant, the reader included


def read_sample(stat_path: Path = Path("/proc/stat"), cores: frozenset[int] | None = None,
                also_own: tuple[int, ...] = ()) -> CpuSample | None:
    """Now's cumulative busy seconds over `cores` (default: this process's affinity) and its
    own CPU seconds, with those of the processes `also_own` (the daemon's front process: its
    work is the daemon's own, not another program's), and the threads runnable at this instant
    less the front's main thread where it is one of them; None where /proc/stat cannot be read."""
    cores = usable_cores() if cores is None else cores
    try:
        lines = stat_path.read_text().splitlines()
    except OSError:
        return None
    busy_ticks = 0
    running = None
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[0] == "procs_running":
            running = int(fields[1])
        if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
            continue
        if int(fields[0][3:]) in cores:
            # user nice system idle iowait irq softirq steal: busy is all but idle and iowait
            values = [int(v) for v in fields[1:9]]
            busy_ticks += sum(values) - values[3] - values[4]
    own_s = own_cpu_s()
    for pid in also_own:
        cpu_s, runs = process_state(pid)
        own_s += cpu_s
        if running is not None and runs:
            running -= 1  # the front's main thread, runnable at the instant, is the daemon's own
    return CpuSample(busy_s=busy_ticks / os.sysconf("SC_CLK_TCK"), own_s=own_s, wall_s=time.monotonic(),
                     running=running)


def own_cpu_s() -> float:
    """This process's CPU seconds (user + system, all threads): one cheap call, for every tick."""
    times = os.times()
    return times.user + times.system


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used; 0 once it is gone."""
    return process_state(pid)[0]


def process_state(pid: int) -> tuple[float, bool]:
    """Process `pid`'s CPU seconds (user + system, all threads) and whether its main thread is
    runnable now; (0, False) once it is gone."""
    fields = stat_fields(f"/proc/{pid}/stat")
    if fields is None:
        return 0.0, False
    return stat_cpu_s(fields), fields[0] == "R"


def stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc stat file (a process's or a thread's) after its command name, from
    the state on (proc(5) numbers them from 3); None once it is gone."""
    try:
        return Path(path).read_text().rpartition(")")[2].split()
    except OSError:
        return None


def stat_cpu_s(fields: list[str]) -> float:
    """CPU seconds (user + system) in `stat_fields`' fields."""
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


def free_now(sample: CpuSample, num_cores: int) -> float | None:
    """Cores left by the threads runnable at the sample's instant, the reader aside (0..num_cores);
    None where the sample has no such count."""
    if sample.running is None:
        return None
    return min(float(num_cores), max(0.0, num_cores - (sample.running - 1)))


def threads_for(free: float, max_threads: int) -> int:
    """Threads to run beside other processes: the free cores, rounded, at least one.

    A core counts as free when other processes used less than half of it.
    """
    return max(1, min(max_threads, int(free + 0.5)))


class CpuThreads:
    """Adapts torch's intra-op thread count to the cores other processes leave free (the
    processes named in `read_sample`'s `also_own`, such as the daemon's front, count as its own).

    `tick()` may change the calling thread's torch thread count; it returns the count in use.
    It measures every `interval_s`; after an idle wait it counts the runnable threads at once
    and measures again `FRESH_S` later. Between measurements a tick reads only `clock` and
    `own_cpu` (about a microsecond): a sample reads /proc/stat and the front's /proc/PID/stat
    (40-70 µs on an idle machine, more on a busy one), too much for every round.
    `sample`, `clock`, `own_cpu`, `sleep` and `set_threads` are injectable for tests.
    """

    def __init__(self, max_threads: int, *, interval_s: float = DEFAULT_INTERVAL_S,
                 num_cores: int | None = None,
                 sample: Callable[[], CpuSample | None] = read_sample,
                 clock: Callable[[], float] = time.monotonic,
                 own_cpu: Callable[[], float] = own_cpu_s,
                 sleep: Callable[[float], None] = time.sleep,
                 set_threads: Callable[[int], None] | None = None) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads {max_threads}: needs at least 1")
        self.max_threads = max_threads
        self.interval_s = interval_s
        self.num_cores = num_cores or len(usable_cores())
        self._sample = sample
        self._clock = clock
        self._own_cpu = own_cpu
        self._sleep = sleep
        self._set_threads = set_threads or _torch_set_threads
        self._last = sample()
        self._tick_at = clock()  # the last tick's clock and own CPU: a wait between two shows there
        self._tick_cpu = own_cpu()
        self._due = self._tick_at + interval_s  # the next measurement
        self.threads = max_threads
        self._applied: int | None = None

    @classmethod
    def up_to_current(cls, also_own: tuple[int, ...] = ()) -> CpuThreads:
        """A policy that never goes above torch's thread count now (OMP_NUM_THREADS, or the
        cores); `also_own`: processes whose CPU counts as the daemon's own (read_sample)."""
        import torch

        return cls(max_threads=torch.get_num_threads(), sample=lambda: read_sample(also_own=also_own))

    def _count_now(self, now: CpuSample) -> int:
        """The count the threads runnable at `now` leave room for. A thread runnable at one
        instant may be a client that has just sent this very request: where others are
        runnable, they are counted again after each of `RECHECK_WAITS_S` until they leave room
        for `max_threads`, and only those runnable every time (a build's) take a core."""
        free = free_now(now, self.num_cores)
        if free is None:
            return 1
        for wait in RECHECK_WAITS_S:
            if threads_for(free, self.max_threads) >= self.max_threads:
                break
            self._sleep(wait)
            again = self._sample()
            later = free_now(again, self.num_cores) if again is not None else None
            if later is None:
                break
            free = max(free, later)
        return threads_for(free, self.max_threads)

    def tick(self) -> int:
        """Re-measure when `interval_s` has passed, or at once after an idle wait; apply the
        count if it changed."""
        clock, cpu = self._clock(), self._own_cpu()
        gap, used = clock - self._tick_at, cpu - self._tick_cpu
        self._tick_at, self._tick_cpu = clock, cpu
        resumed = gap > FRESH_S and used < 0.5 * gap  # this process waited since the round before
        if resumed or clock >= self._due:
            now = self._sample()
            wait = self.interval_s
            if now is not None and self._last is not None:
                self.threads = threads_for(free_cores(self._last, now, self.num_cores), self.max_threads)
                if resumed and self.threads < self.max_threads:  # others' past gave it; the present may give more
                    self.threads = max(self.threads, self._count_now(now))
            if resumed:
                wait = min(FRESH_S, self.interval_s)  # the window from here holds the present
            self._last = now
            self._due = clock + wait
        threads = self.threads
        if threads != self._applied:
            self._set_threads(threads)
            self._applied = threads
        return threads


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
