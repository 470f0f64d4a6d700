"""Row invariance: a row's KV and logits bits depend only on its own tokens and context.

Bit equality (`torch.equal`) on tiny random llama / qwen2 / qwen3 models and on the default
model, in bf16 and fp32, and in mode "int4" (4-bit weights, CPU bf16). Prompts are longer than one attention block (256 rows) so several
blocks, partially masked blocks and chunks that straddle a block edge are exercised.
"""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu import cpu_kernels
from prefixd.scheduler.records import LaneWork, RoundPlan
from tests.gpu.runner_helpers import DEVICE, kv_equal, lane_pages, make_runner, pages, prompt, run_chunks, work

DTYPES = [torch.bfloat16, torch.float32]
FAMILIES = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"]
# (dtype, mode): the int4 mode runs on the CPU in bf16 only
NUMERICS = [(d, "invariant") for d in DTYPES] + (
    [(torch.bfloat16, "int4")] if DEVICE.type == "cpu" and cpu_kernels.available()[0] else [])


def _numerics_id(p: tuple[torch.dtype, str]) -> str:
    return str(p[0])[6:] + ("" if p[1] == "invariant" else f"-{p[1]}")


@pytest.fixture(scope="module", params=[(f, n) for f in FAMILIES for n in NUMERICS],
                ids=lambda p: f"{p[0][5:-4]}-{_numerics_id(p[1])}")
def tiny_runner(request):
    family, (dtype, mode) = request.param
    return make_runner(request.getfixturevalue(family), dtype, mode=mode)


@pytest.fixture(scope="module", params=NUMERICS, ids=_numerics_id)
def default_runner(request, default_gguf):
    dtype, mode = request.param
    return make_runner(default_gguf, dtype, mode=mode)


def check_chunking(runner, n: int, *, fives: bool = True, single_rows: int | None = None) -> None:
    """n rows prefilled in one shot equal them in chunks: mixed sizes, 255 and the rest, 5s
    (`fives`), and one row a round (the last `single_rows` rows; default all n), logits and K/V."""
    tokens = prompt(n, seed=1)
    one = run_chunks(runner, 0, tokens, lane_pages(0), [n])
    singles = n if single_rows is None else single_rows
    plans = {
        "mixed": [1, 16, 33, 7, 200, n - 257],
        "255+rest": [255, n - 255],
    }
    if fives:
        plans["5s"] = [5] * (n // 5) + ([n % 5] if n % 5 else [])
    plans["one row at a time"] = ([n - singles] if singles < n else []) + [1] * singles
    for i, (name, chunks) in enumerate(plans.items(), start=1):
        got = run_chunks(runner, i, tokens, lane_pages(i), chunks)
        assert torch.equal(got, one), f"chunks {name}: logits differ"
        assert kv_equal(runner, lane_pages(0), runner, lane_pages(i), n), f"chunks {name}: KV differs"


def check_lane_beside_others(runner, n: int) -> None:
    """Lane 0: prefill n rows in 3 rounds then 4 decode rounds; alone vs with 7 busy lanes."""
    tokens = prompt(n + 4, seed=2)
    cuts = [0, n // 3, 2 * n // 3, n, n + 1, n + 2, n + 3, n + 4]

    def lane0(i: int) -> LaneWork:
        lo, hi = cuts[i], cuts[i + 1]
        return work(0, lo, tokens[lo:hi], lane_pages(0), prefill=i < 3)

    alone = [runner.run_round(RoundPlan((lane0(i),))).lanes[0].logits for i in range(7)]
    others = {lane: prompt(11 * lane + 3, seed=10 + lane) for lane in range(1, 8)}
    done = {lane: 0 for lane in others}
    together = []
    for i in range(7):
        lanes = [lane0(i)]
        for lane, toks in others.items():
            step = 1 if done[lane] >= len(toks) - 4 else min(9 + lane, len(toks) - 4 - done[lane])
            if done[lane] + step > len(toks):
                continue
            piece = toks[done[lane] : done[lane] + step]
            lanes.append(work(lane, done[lane], piece, lane_pages(lane), prefill=step > 1))
            done[lane] += step
        order = lanes[::-1] if i % 2 else lanes  # lane 0 first and last in the batch
        res = runner.run_round(RoundPlan(tuple(order))).by_lane()
        together.append(res[0].logits)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert torch.equal(a, b), f"round {i}: lane 0's logits changed beside other lanes"


def check_verify_equals_decode(runner, n: int, k: int = 4) -> None:
    tokens = prompt(n + k + 1, seed=3)
    base = tokens[:n]
    run_chunks(runner, 0, base, lane_pages(0), [n])
    run_chunks(runner, 1, base, lane_pages(1), [n])
    stepped = run_chunks(runner, 0, tokens[n : n + k + 1], lane_pages(0), [1] * (k + 1), start=n)
    res = runner.run_round(RoundPlan((work(1, n, tokens[n : n + k + 1], lane_pages(1), prefill=False),)))
    assert torch.equal(res.lanes[0].logits, stepped)
    assert kv_equal(runner, lane_pages(0), runner, lane_pages(1), n + k + 1)


def test_tiny_chunked_prefill_equals_one_shot(tiny_runner):
    check_chunking(tiny_runner, 300)


def test_tiny_lane_alone_equals_beside_seven_lanes(tiny_runner):
    check_lane_beside_others(tiny_runner, 290)


def test_tiny_verify_pass_equals_stepwise_decode(tiny_runner):
    check_verify_equals_decode(tiny_runner, 254)


@pytest.mark.slow
def test_default_chunked_prefill_equals_one_shot(default_runner):
    check_chunking(default_runner, 270, fives=False)


@pytest.mark.slow
def test_default_lane_alone_equals_beside_seven_lanes(default_runner):
    check_lane_beside_others(default_runner, 270)


@pytest.mark.slow
def test_default_verify_pass_equals_stepwise_decode(default_runner):
    check_verify_equals_decode(default_runner, 254)


@pytest.mark.skipif(not any(mode == "int4" for _, mode in NUMERICS), reason="mode int4 needs its CPU kernels")
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_rows_past_four_key_chunks_have_one_set_of_bits_alone_and_beside_others(tiny_llama_dir, threads):
    """int4's attention reduces a row's keys in chunks of 512. A lone lane's row of 1,600 keys
    is cut by chunks between the threads and joined after; beside other lanes it is one task.
    Lane 0 decodes 5 rows alone, lane 1 the same rows beside five lanes prefilling, lane 7
    verifies them in one pass: the same logits and KV bits all three ways."""
    n, per_lane = 1600, 110  # 1,760 rows a lane
    runner = make_runner(tiny_llama_dir, torch.bfloat16, mode="int4", num_pages=8 * per_lane)

    def table(lane: int) -> tuple[int, ...]:
        return pages(per_lane * lane, per_lane)

    tokens = prompt(n + 5, seed=4)
    others = {lane: prompt(300, seed=20 + lane) for lane in range(2, 7)}
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for lane in (0, 1, 7):
            run_chunks(runner, lane, tokens[:n], table(lane), [512, 512, 576])
        alone = run_chunks(runner, 0, tokens[n:], table(0), [1] * 5, start=n)
        beside = []
        for i in range(5):
            lanes = [work(1, n + i, tokens[n + i : n + i + 1], table(1), prefill=False)]
            lanes += [work(lane, 60 * i, toks[60 * i : 60 * (i + 1)], table(lane)) for lane, toks in others.items()]
            beside.append(runner.run_round(RoundPlan(tuple(lanes))).by_lane()[1].logits)
        verified = runner.run_round(RoundPlan((work(7, n, tokens[n:], table(7), prefill=False),))).lanes[0].logits
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(torch.cat(beside), alone), "beside other lanes: logits differ"
    assert torch.equal(verified, alone), "one verify pass: logits differ"
    for lane in (1, 7):
        assert kv_equal(runner, table(0), runner, table(lane), n + 5), f"lane {lane}: KV differs"
