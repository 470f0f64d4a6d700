"""The CPU thread policy: counts from measured free cores, and bits that never depend on them."""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu import cpu_kernels
from prefixd.gpu.threads import (FRESH_S, RECHECK_WAITS_S, CpuSample, CpuThreads, free_cores, free_now, read_sample,
                                 threads_for)
from tests.gpu.runner_helpers import DEVICE, lane_pages, make_runner, prompt, run_chunks


def test_free_cores_subtracts_this_process_and_other_processes():
    before = CpuSample(busy_s=100.0, own_s=10.0, wall_s=50.0)
    # 2 s of wall time on 2 cores: 3 s busy in all, 1 s of it ours -> others used one core
    after = CpuSample(busy_s=103.0, own_s=11.0, wall_s=52.0)
    assert free_cores(before, after, 2) == 1.0
    assert free_cores(before, CpuSample(101.0, 11.0, 52.0), 2) == 2.0  # only we were busy
    assert free_cores(before, CpuSample(110.0, 10.0, 52.0), 2) == 0.0  # others on every core


@pytest.mark.parametrize(("free", "threads"), [(0.0, 1), (0.4, 1), (1.0, 1), (1.4, 1), (1.6, 2), (2.0, 2), (7.9, 4)])
def test_threads_for_rounds_free_cores_within_one_and_max(free, threads):
    assert threads_for(free, 4 if free > 2 else 2) == threads


class Machine:
    """A two-core machine the policy reads: a clock, this process's CPU seconds, the busy
    seconds over the cores, and the threads runnable at each sample (this one included)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.own = 0.0
        self.busy = 0.0
        self.running = [1]  # consumed one per sample; the last one repeats
        self.samples = 0
        self.slept: list[float] = []

    def run(self, seconds: float, *, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + other_cores)

    def sample(self) -> CpuSample:
        self.samples += 1
        running = self.running.pop(0) if len(self.running) > 1 else self.running[0]
        return CpuSample(busy_s=self.busy, own_s=self.own, wall_s=self.now, running=running)

    def policy(self, applied: list[int]) -> CpuThreads:
        return CpuThreads(2, interval_s=1.0, num_cores=2, sample=self.sample, clock=lambda: self.now,
                          own_cpu=lambda: self.own, sleep=self.slept.append, set_threads=applied.append)


def test_tick_applies_a_count_once_and_remeasures_after_the_interval():
    m, applied = Machine(), []
    policy = m.policy(applied)
    counts = []
    for own, other in [(2.0, 0.0), (2.0, 0.0), (1.0, 2.0), (1.0, 2.0), (2.0, 0.0), (2.0, 0.0)]:
        m.run(0.5, own_cores=own, other_cores=other)  # rounds back to back, half a second apart
        counts.append(policy.tick())
    # the second measurement (at 2 s) sees others' two busy cores; the third (at 3 s) an idle machine
    assert counts == [2, 2, 2, 1, 1, 2]
    assert applied == [2, 1, 2]
    assert m.samples == 1 + 3  # construction, then one a second: a tick between reads no /proc


@pytest.mark.parametrize(("wait_s", "running", "threads", "rechecks"), [
    (1.2, [1], 2, 0),  # a wait under 1.5 intervals counts too; nothing else runnable now: both cores
    (10.0, [1], 2, 0),
    (10.0, [3, 1], 2, 1),  # the client that sent the request was runnable, then blocked
    (10.0, [3, 2, 1], 2, 2),
    (10.0, [3, 3, 2, 2, 1], 2, 4),  # a client sending eight streams: runnable for 4-8 ms
    (10.0, [3, 3], 1, 4),  # a build still runs: the window's count holds
    (10.0, [3, 2], 1, 4),  # so does a build on one core
])
def test_after_an_idle_wait_the_count_follows_the_present(wait_s, running, threads, rechecks):
    """Others kept both cores busy while the engine waited idle. The first round after the
    wait takes its count from what is runnable now (where others are, counted again after
    each of RECHECK_WAITS_S until they leave both cores or the waits run out), and the next
    measurement comes FRESH_S later, over the present alone."""
    m, applied = Machine(), []
    policy = m.policy(applied)
    m.run(0.5, own_cores=2.0, other_cores=0.0)
    assert policy.tick() == 2
    m.run(wait_s, own_cores=0.0, other_cores=2.0)  # the wait (the round before it was short)
    m.running = list(running)
    assert policy.tick() == threads
    assert m.slept == list(RECHECK_WAITS_S[:rechecks])
    m.run(FRESH_S / 2, own_cores=1.0, other_cores=0.0)
    m.running = [1]
    samples = m.samples
    assert policy.tick() == threads and m.samples == samples  # not yet
    m.run(FRESH_S / 2, own_cores=1.0, other_cores=0.0)
    assert policy.tick() == 2  # measured over the present: others idle
    assert applied == ([2] if threads == 2 else [2, 1, 2])


def test_after_a_quiet_wait_nothing_is_counted_again():
    """Where the window already leaves every core free, the runnable threads cannot raise
    the count: the first round after the wait neither reads them twice nor sleeps."""
    m, applied = Machine(), []
    policy = m.policy(applied)
    m.run(0.5, own_cores=2.0, other_cores=0.0)
    assert policy.tick() == 2
    m.run(5.0, own_cores=0.0, other_cores=0.0)
    m.running = [3]  # momentarily runnable others (a client sending, say)
    samples = m.samples
    assert policy.tick() == 2
    assert m.slept == [] and m.samples == samples + 1


def test_a_long_round_is_not_an_idle_wait():
    """A prefill round of several seconds leaves a long gap between ticks with this process
    busy throughout: the window is the present, measured on the interval, no recount."""
    m, applied = Machine(), []
    policy = m.policy(applied)
    m.run(3.0, own_cores=1.0, other_cores=1.0)  # one long round beside one busy core
    m.running = [1]  # whatever runs at this instant, the window decides
    assert policy.tick() == 1
    assert m.slept == []
    m.run(0.5, own_cores=1.0, other_cores=0.0)
    assert policy.tick() == 1  # the next measurement is a whole interval away


def test_read_sample_reads_this_machine():
    sample = read_sample()
    if sample is None:
        pytest.skip("no /proc/stat here")
    assert sample.busy_s > 0 and sample.own_s > 0
    assert sample.running is not None and sample.running >= 1  # this thread, reading


def test_free_now_leaves_the_reader_out():
    sample = CpuSample(busy_s=0.0, own_s=0.0, wall_s=0.0, running=1)
    assert free_now(sample, 2) == 2.0
    assert free_now(CpuSample(0.0, 0.0, 0.0, running=2), 2) == 1.0
    assert free_now(CpuSample(0.0, 0.0, 0.0, running=9), 2) == 0.0
    assert free_now(CpuSample(0.0, 0.0, 0.0), 2) is None


@pytest.mark.skipif(DEVICE.type != "cpu", reason="torch CPU thread counts")
@pytest.mark.parametrize("mode", ["invariant", pytest.param("int4", marks=pytest.mark.skipif(
    not cpu_kernels.available()[0], reason="mode int4's CPU kernels cannot be built here"))])
def test_a_rounds_bits_do_not_depend_on_the_thread_count(tiny_llama_dir, mode):
    """The policy changes the count between rounds: a lane's logits and KV must not notice."""
    runner = make_runner(tiny_llama_dir, torch.bfloat16, mode=mode)
    tokens = prompt(280, seed=4)
    chunks = [260, 1, 1, 18]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_chunks(runner, 0, tokens, lane_pages(0), chunks)
        torch.set_num_threads(max(2, before))
        many = run_chunks(runner, 1, tokens, lane_pages(1), chunks)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)

