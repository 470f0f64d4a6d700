"""KV pool sizing from the daemon config."""

from __future__ import annotations

from types import SimpleNamespace

from prefixd.daemon.config import AUTO_CACHE_MAX_BYTES_CPU, DaemonConfig
from prefixd.engine.runtime import context_line, kv_bytes_per_page, lanes_fit_context, mem_available_bytes, plan_num_pages

PAGE = 1000


def test_lanes_reserve_full_context_and_cache_off_adds_nothing():
    cfg = DaemonConfig(lanes=2, page_size=16, cache=False)
    assert plan_num_pages(cfg, kv_bytes_per_page=PAGE, max_context=100, available_bytes=None) == 2 * 7


def test_explicit_budget_adds_budget_pages():
    cfg = DaemonConfig(lanes=2, page_size=16, cache_budget_bytes=50_500)
    assert plan_num_pages(cfg, kv_bytes_per_page=PAGE, max_context=100, available_bytes=None) == 14 + 50


def test_auto_budget_takes_half_the_available_memory_minus_the_lanes():
    cfg = DaemonConfig(lanes=2, page_size=16)
    assert plan_num_pages(cfg, kv_bytes_per_page=PAGE, max_context=100, available_bytes=100_000) == 14 + 36


def test_auto_budget_on_cpu_is_capped():
    cfg = DaemonConfig(lanes=1, page_size=16)
    pages = plan_num_pages(cfg, kv_bytes_per_page=PAGE, max_context=16, available_bytes=1 << 40)
    assert pages == 1 + AUTO_CACHE_MAX_BYTES_CPU // PAGE


def test_auto_budget_without_a_memory_figure_doubles_the_lane_pages():
    cfg = DaemonConfig(lanes=2, page_size=16, device="cuda")
    assert plan_num_pages(cfg, kv_bytes_per_page=PAGE, max_context=100, available_bytes=None) == 28


def test_kv_bytes_per_page_counts_k_and_v_of_every_layer():
    model = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    assert kv_bytes_per_page(model, DaemonConfig(dtype="bf16", page_size=16)) == 2 * 30 * 3 * 64 * 2 * 16


def test_kv_bytes_per_page_of_mode_int4_are_its_8bit_pages():
    """A byte a dim and an fp32 scale a 32 dims (kv_pool.py), where the head is a multiple of 32
    wide; bf16 key pages at other widths: the planner's figure is the pool's own."""
    import torch

    from prefixd.gpu.kv_pool import KVPool, kv_pages

    cfg = DaemonConfig(dtype="bf16", page_size=16)
    for head_dim, per_head in ((64, 64 + 8), (16, 16 * 2)):
        model = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=head_dim)
        planned = kv_bytes_per_page(model, cfg, "int4")
        assert planned == 2 * 30 * 3 * per_head * 16
        pool = KVPool(num_layers=30, num_pages=1, page_size=16, num_kv_heads=3, head_dim=head_dim,
                      device="cpu", dtype=torch.bfloat16, **kv_pages("int4", head_dim))
        assert pool.bytes_per_page == planned


SMOLLM2_PAGE = 2 * 30 * 3 * 64 * 2 * 16  # the default model's KV page in bf16: 368,640 bytes


def test_the_context_is_the_longest_whose_lane_kv_fits_half_the_memory():
    cfg = DaemonConfig()  # 8 lanes on the CPU, pages of 16 rows
    assert lanes_fit_context(cfg, kv_bytes_per_page=SMOLLM2_PAGE, available_bytes=8 << 30) == 1456 * 16
    # 1 GiB for 8 lanes of 368,640-byte pages: 364 pages each
    assert lanes_fit_context(cfg, kv_bytes_per_page=SMOLLM2_PAGE, available_bytes=2 << 30) == 364 * 16 == 5824
    assert lanes_fit_context(cfg, kv_bytes_per_page=SMOLLM2_PAGE, available_bytes=1000) == 16  # one page at least
    assert lanes_fit_context(cfg, kv_bytes_per_page=SMOLLM2_PAGE, available_bytes=None) is None
    assert lanes_fit_context(DaemonConfig(lanes=1), kv_bytes_per_page=SMOLLM2_PAGE,
                             available_bytes=2 << 30) == 2912 * 16


def test_the_start_up_line_says_the_context_and_why():
    line = lambda cfg, n, available: context_line(  # noqa: E731
        cfg, max_context=n, model_max_context=8192, kv_bytes_per_page=SMOLLM2_PAGE, available_bytes=available)
    assert line(DaemonConfig(), 8192, 8 << 30) == "context 8192 tokens (the model's); 8 lanes x 8192 rows of KV take 1.41 GiB"
    assert line(DaemonConfig(), 5824, 2 << 30) == (
        "context 5824 tokens (the model's is 8192): 8 lanes x context KV must fit in 1.00 GiB (50% of the 2.00 GiB "
        "of RAM left); --max-context raises it (fewer --lanes lengthen it)")
    assert line(DaemonConfig(max_context=512), 512, 2 << 30) == (
        "context 512 tokens (--max-context); 8 lanes x 512 rows of KV take 90.0 MiB")


def test_a_default_load_serves_the_models_context_where_the_lanes_fit_and_less_where_not(tmp_path, monkeypatch,
                                                                                         caplog):
    import logging

    from prefixd.engine import runtime as runtime_module
    from tests.helpers.tiny_models import make_tiny_hf_dir

    model = make_tiny_hf_dir(tmp_path / "tiny", "llama", seed=1)  # context 4096; KV 512 bytes a row in fp32
    cfg = DaemonConfig(model=str(model), dtype="fp32", lanes=2, cache=False)
    caplog.set_level(logging.INFO, logger="prefixd.runtime")
    monkeypatch.setattr(runtime_module, "mem_available_bytes", lambda: 64 << 20)
    roomy = runtime_module.load_runtime(cfg, observer=None)
    assert roomy.model_info["max_context"] == roomy.engine.max_context == 4096
    # two lanes of ten 8,192-byte pages fill half of this
    monkeypatch.setattr(runtime_module, "mem_available_bytes", lambda: 2 * 2 * 10 * 8192 + 100)
    tight = runtime_module.load_runtime(cfg, observer=None)
    assert tight.model_info["max_context"] == tight.engine.max_context == 160
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("context ")]
    assert lines == ["context 4096 tokens (the model's); 2 lanes x 4096 rows of KV take 4.0 MiB",
                     "context 160 tokens (the model's is 4096): 2 lanes x context KV must fit in 0.2 MiB (50% of "
                     "the 0.3 MiB of RAM left); --max-context raises it (fewer --lanes lengthen it)"]


def test_mem_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemAvailable:   2048 kB\n")
    assert mem_available_bytes(meminfo) == 2048 * 1024
    assert mem_available_bytes(tmp_path / "missing") is None


def test_loaded_runtime_reports_the_resolved_mode_and_runs_the_thread_policy(tmp_path):
    import torch

    from prefixd.engine.runtime import load_runtime
    from tests.helpers.tiny_models import make_tiny_hf_dir

    model = make_tiny_hf_dir(tmp_path / "tiny", "llama", seed=1, tie_word_embeddings=True)
    threads = torch.get_num_threads()
    try:
        from prefixd.gpu import cpu_kernels

        # auto: int4 in bf16 where its kernels have their fast paths
        for dtype, mode in (("bf16", "int4" if cpu_kernels.fast() else "invariant"), ("fp32", "invariant")):
            cfg = DaemonConfig(model=str(model), dtype=dtype, lanes=1, max_context=64, cache=False)
            runtime = load_runtime(cfg, observer=None)
            assert (runtime.model_info["mode"], runtime.model_info["dtype"]) == (mode, dtype)
            kernels = runtime.model_info["cpu_kernels"]
            assert kernels is None if mode == "invariant" else set(kernels) == {"int4_product", "attention", "kv_pages"}
            if kernels is not None:  # the tiny model's heads are 16 wide: bf16 key pages
                assert kernels["kv_pages"] == "bf16" and kernels["attention"] == cpu_kernels.attention_path()
            # --draft auto: prompt lookup for llama in both modes, shown in status
            assert (runtime.model_info["draft"], runtime.model_info["draft_chosen_by"]) == ("ngram", "auto")
            assert runtime.model_info["cuda_graphs"] is None  # the CPU captures no decode programs
            assert runtime.overlap is False and runtime.model_info["overlap"] is False  # auto: CUDA only
            assert runtime.engine.status()["draft"]["mode"] == "ngram"
            assert runtime.before_round is not None and runtime.before_round() >= 1
    finally:
        torch.set_num_threads(threads)  # the policy may have lowered this thread's count


def _tiny_hybrid(path, mtp_layers: int):
    import shutil
    from pathlib import Path

    from prefixd.gpu.families.qwen3_5_tiny import make_tiny_hybrid_dir
    from tests.helpers.tiny_models import _tokenizer_files

    make_tiny_hybrid_dir(path, seed=0, mtp_layers=mtp_layers)
    shutil.copyfile(Path(_tokenizer_files()) / "tokenizer.json", path / "tokenizer.json")
    return path


def test_draft_mtp_runs_the_head_and_a_model_without_one_is_refused_at_start_up(tmp_path):
    import pytest

    from prefixd.engine.runtime import load_runtime
    from prefixd.daemon.startup import StartupError

    cfg = DaemonConfig(model=str(_tiny_hybrid(tmp_path / "mtp", 1)), dtype="fp32", lanes=2, max_context=64,
                       cache=False, draft="mtp")
    runtime = load_runtime(cfg, observer=None)
    assert runtime.model_info["draft"] == "mtp" and runtime.engine.status()["draft"]["mode"] == "mtp"
    assert runtime.engine.info.draft_head and runtime.engine.info.lookahead == 1
    plain = DaemonConfig(model=str(_tiny_hybrid(tmp_path / "plain", 0)), dtype="fp32", lanes=2, max_context=64,
                         cache=False, draft="mtp")
    with pytest.raises(StartupError, match="--draft mtp: .* has no MTP"):
        load_runtime(plain, observer=None)
