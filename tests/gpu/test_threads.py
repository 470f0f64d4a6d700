"""The CPU thread policy: counts from measured free cores, and bits that never depend on them."""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu import cpu_kernels
from prefixd.gpu.threads import FRESH_S, CpuSample, CpuThreads, free_cores, read_sample, threads_for
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


def test_tick_applies_a_count_once_and_remeasures_after_the_interval():
    samples = iter([CpuSample(0.0, 0.0, 0.0),  # at construction
                    CpuSample(2.0, 0.0, 1.0),  # others busy 2 s of 1 s wall on 2 cores: none free
                    CpuSample(2.0, 0.0, 2.0)])  # an idle second: both free
    taken: list[CpuSample] = []

    def sample() -> CpuSample:
        taken.append(next(samples))
        return taken[-1]

    # the clock at construction, then at each tick (and again after a measurement, for the next)
    clock = iter([0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0])
    applied: list[int] = []
    policy = CpuThreads(2, interval_s=1.0, num_cores=2, sample=sample, clock=lambda: next(clock),
                        set_threads=applied.append)
    assert [policy.tick() for _ in range(4)] == [2, 1, 1, 2]
    assert applied == [2, 1, 2]
    assert len(taken) == 3  # a tick before the interval reads the clock, not /proc


def test_after_an_idle_wait_the_policy_looks_again_within_fresh_s():
    """A window that spans an idle wait holds others' past: its count holds only until a
    measurement FRESH_S later, not a whole interval later."""
    samples = iter([CpuSample(0.0, 0.0, 0.0),  # at construction
                    CpuSample(20.0, 0.0, 10.0),  # 10 s idle while others kept both cores busy
                    CpuSample(20.2, 0.2, 10.1)])  # then only this process: both free
    clock = iter([0.0,  # construction
                  10.0, 10.0,  # a tick that measures (and the clock for the next)
                  10.05,  # before FRESH_S: no measurement
                  10.1, 10.1,  # at FRESH_S: measures again
                  10.5])  # a normal interval from here: none yet
    applied: list[int] = []
    policy = CpuThreads(2, interval_s=1.0, num_cores=2, sample=lambda: next(samples), clock=lambda: next(clock),
                        set_threads=applied.append)
    assert FRESH_S == 0.1
    assert [policy.tick() for _ in range(4)] == [1, 1, 2, 2]
    assert applied == [1, 2]


def test_read_sample_reads_this_machine():
    sample = read_sample()
    if sample is None:
        pytest.skip("no /proc/stat here")
    assert sample.busy_s > 0 and sample.own_s > 0


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

