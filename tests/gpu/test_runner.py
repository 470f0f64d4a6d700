"""ModelRunner as a Device: info, page isolation, page copies, images, sampling, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixd.gpu.families import build_family
from prefixd.gpu.digest import logits_sha256
from prefixd.scheduler.records import (Capture, ImageIdentity, ImageRows, LaneWork, PageCopy, Restore,
                                       RoundPlan, SamplerSetup, SamplingParams, StoredSample)
from tests.gpu.runner_helpers import capture, kv_equal, make_runner, pages, prompt, run_chunks, work


@pytest.fixture(scope="module")
def runner(tiny_qwen2_dir):
    return make_runner(tiny_qwen2_dir, torch.float32, num_lanes=4, num_pages=64)


def test_info_states_exact_sizes(runner):
    c = runner.config
    info = runner.info
    assert info.kv_bytes_per_page == 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4
    assert info.logits_row_bytes == 4 * c.vocab_size
    assert (info.num_lanes, info.num_pages, info.page_size) == (4, 64, 16)
    assert info.invariant_rows is True and info.lane_state_bytes == 0
    assert info.vocab_size == c.vocab_size == 49216  # padded vocab of the tiny qwen2


def test_lane_reads_only_its_own_pages(runner):
    tokens = prompt(40, seed=5)
    alone = run_chunks(runner, 0, tokens, pages(0, 4), [40])
    runner.kv.storage[:, :, 4:].normal_()  # other pages hold unrelated (finite) rows
    again = run_chunks(runner, 1, tokens, pages(8, 4), [40])
    assert torch.equal(alone, again)


def test_pages_can_be_shared_out_of_order(runner):
    """A lane whose page table lists pages in any order reads rows by table position."""
    tokens = prompt(40, seed=6)
    ref = run_chunks(runner, 0, tokens, pages(0, 3), [40])
    got = run_chunks(runner, 0, tokens, (30, 12, 21), [40])
    assert torch.equal(ref, got)
    k_ref, v_ref = runner.kv_rows(1, pages(0, 3), 40)
    k, v = runner.kv_rows(1, (30, 12, 21), 40)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_copy_pages_lets_a_lane_continue_from_copies(runner):
    tokens = prompt(41, seed=7)
    run_chunks(runner, 0, tokens[:33], pages(0, 3), [33])
    runner.run_round(RoundPlan(page_copies=tuple(PageCopy(s, d) for s, d in zip((0, 1, 2), (40, 41, 42)))))
    assert kv_equal(runner, pages(0, 3), runner, (40, 41, 42), 33)
    direct = run_chunks(runner, 0, tokens[33:], pages(0, 3), [8], start=33)
    resumed = run_chunks(runner, 1, tokens[33:], (40, 41, 42), [8], start=33)
    assert torch.equal(direct, resumed)


def test_image_rows_replace_token_embeddings(runner):
    tokens = prompt(30, seed=8)
    ref = run_chunks(runner, 0, tokens, pages(0, 2), [30])
    emb = runner.model.embed[torch.tensor(tokens[10:16])].float().numpy()
    placeholder = tokens[:10] + (7,) * 6 + tokens[16:]
    image = ImageRows(ImageIdentity(at=10, tokens=6, gh=2, gw=3, hash=b"x"), np.ascontiguousarray(emb))
    first = LaneWork(2, 0, placeholder[:13], pages(8, 2), True, logits_rows=tuple(range(13)),
                     images=(image,))
    second = LaneWork(2, 13, placeholder[13:], pages(8, 2), True, logits_rows=tuple(range(17)),
                      images=(image,))
    got = torch.cat([runner.run_round(RoundPlan((w,))).lanes[0].logits for w in (first, second)])
    assert torch.equal(got, ref)


def test_greedy_sample_is_argmax_and_sample_from_stored_row_agrees(runner):
    tokens = prompt(20, seed=9)
    setup = SamplerSetup(3, SamplingParams(), tokens)
    w = LaneWork(3, 0, tokens, pages(12, 2), True, sample_rows=(19,), logits_rows=(19,), digest_rows=(19,))
    res = runner.run_round(RoundPlan((w,), samplers=(setup,))).lanes[0]
    row = res.logits[0]
    tok_vocab = runner.tokenizer.vocab_size
    assert res.sampled == (int(torch.argmax(row[:tok_vocab])),)
    assert res.digests == logits_sha256(res.logits)  # computed where the row is, from its fp32 bytes
    stored = runner.run_round(RoundPlan(samplers=(setup,), stored=(StoredSample(3, res.logits, 0, digest=True),)))
    assert stored.lanes == () and stored.stored[0].sampled == res.sampled and stored.stored[0].digests == res.digests


def test_page_copies_run_in_plan_order(runner):
    """A page one copy reads may be the page a later copy of the same round writes."""
    tokens = prompt(16, seed=12)
    run_chunks(runner, 0, tokens, (50,), [16])
    run_chunks(runner, 0, prompt(16, seed=13), (51,), [16])
    runner.run_round(RoundPlan(page_copies=(PageCopy(51, 52), PageCopy(50, 51), PageCopy(51, 53))))
    assert kv_equal(runner, (53,), runner, (50,), 16) and not kv_equal(runner, (52,), runner, (50,), 16)


def test_attention_only_lane_state_is_empty(runner):
    state = capture(runner, 0)
    assert state.nbytes == 0
    runner.run_round(RoundPlan(restores=(Restore(0, state),)))
    res = runner.run_round(RoundPlan(resets=(0,), captures=(Capture(0, 0),)))
    assert [(c.lane, c.cut, c.state.nbytes) for c in res.captured] == [(0, 0, 0)]


@pytest.mark.parametrize("bad, match", [
    (LaneWork(0, 0, (1, 2), (), True), "pages cannot hold"),
    (LaneWork(9, 0, (1, 2), (0,), True), "lane 9"),
    (LaneWork(0, 0, (1, 2), (0,), True, logits_rows=(2,)), "row 2 outside"),
])
def test_bad_work_raises_before_running(runner, bad, match):
    with pytest.raises(ValueError, match=match):
        runner.run_round(RoundPlan((bad,)))


def test_a_lane_twice_in_one_round_raises(runner):
    w = work(0, 0, (1, 2), (0,))
    with pytest.raises(ValueError, match="twice"):
        runner.run_round(RoundPlan((w, w)))


def test_sampling_without_a_sampler_set_up_raises(runner):
    with pytest.raises(RuntimeError, match="SamplerSetup"):
        runner.run_round(RoundPlan((LaneWork(2, 0, (1,), (0,), True, sample_rows=(0,)),)))


def test_unknown_family_raises():
    class Cfg:
        family = "nope"

    class Ckpt:
        config = Cfg()

    with pytest.raises(ValueError, match="no model code for family 'nope'"):
        build_family(Ckpt(), torch.device("cpu"), torch.float32)


def test_each_family_is_one_record_with_its_model_code():
    """Parsers, GGUF map and model code of a family come from one registry record: every
    registered family names a builder that imports, and a mode it lacks is refused by name."""
    import importlib

    from prefixd.gpu.config import family_record, registered_families

    assert {"llama", "qwen2", "qwen3", "qwen3_5"} <= set(registered_families())
    for family in registered_families():
        record = family_record(family)
        module, _, name = record.build.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), family
        assert "invariant" in record.modes
    assert family_record("llama").modes == ("invariant", "int4")
    assert family_record("qwen3_5").from_gguf is not None and family_record("qwen3_5").modes == ("invariant",)

    class Ckpt:
        class config:
            family = "qwen3_5"

    with pytest.raises(ValueError, match="family 'qwen3_5' has no mode 'int4'"):
        build_family(Ckpt(), torch.device("cpu"), torch.bfloat16, "int4")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_is_row_invariant(tiny_llama_dir):
    r = make_runner(tiny_llama_dir, torch.bfloat16, device=torch.device("cuda"))
    tokens = prompt(70, seed=11)
    one = run_chunks(r, 0, tokens, pages(0), [70])
    assert torch.equal(run_chunks(r, 1, tokens, pages(12), [1, 16, 33, 7, 13]), one)
    assert torch.equal(run_chunks(r, 2, tokens, pages(24), [1] * 70), one)


def test_rope_table_growth_keeps_earlier_positions_bits(tiny_llama_dir):
    import json

    from prefixd.gpu.config import config_from_hf
    from prefixd.gpu.rope import RopeTable

    config = config_from_hf(json.loads((tiny_llama_dir / "config.json").read_text()))
    table = RopeTable(config, device=torch.device("cpu"), size=16)
    before = table.lookup(torch.tensor([3, 15]))
    after = table.lookup(torch.tensor([3, 15, 40]))
    assert table.size == 64
    assert torch.equal(before[0], after[0][:2]) and torch.equal(before[1], after[1][:2])


def test_q_scaled_tables_have_the_bits_of_the_per_round_build_across_growth(tiny_llama_dir):
    """RopeTable.q_scaled (tables kept for every position) against the build it replaced:
    lookup, rotation_tables, scale_q_tables; before and after the table grows."""
    import json

    from prefixd.gpu.config import config_from_hf
    from prefixd.gpu.model import scale_q_tables
    from prefixd.gpu.rope import RopeTable, rotation_tables

    config = config_from_hf(json.loads((tiny_llama_dir / "config.json").read_text()))
    table = RopeTable(config, device=torch.device("cpu"), size=16)
    heads, kv_heads, scale = 6, 2, 0.125
    for positions in ([0, 3, 15, 7], [3, 40, 15], [100, 2, 63]):  # 40, then 100: the table grows
        at = torch.tensor(positions)
        got = table.q_scaled(at, heads, kv_heads, scale)
        want = tuple(scale_q_tables(t, heads, kv_heads, scale) for t in rotation_tables(*table.lookup(at)))
        for g, w in zip(got, want):
            assert g.is_contiguous() and g.shape == (len(positions), heads + kv_heads, config.head_dim)
            assert torch.equal(g.view(torch.int32), w.contiguous().view(torch.int32))
    assert table.size == 128


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 4.0},
])
def test_rope_scaling_frequencies_match_transformers(rope_scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from prefixd.gpu.config import config_from_hf
    from prefixd.gpu.rope import inverse_frequencies

    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                     rope_theta=500000.0, rope_scaling=rope_scaling, max_position_embeddings=131072)
    ours = config_from_hf(hf.to_dict())
    ref, _ = ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](hf, torch.device("cpu"))
    got = inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    assert torch.allclose(got, ref.float(), rtol=1e-6, atol=0)
