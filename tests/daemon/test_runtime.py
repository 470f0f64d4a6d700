"""KV pool sizing from the daemon config."""

from __future__ import annotations

from types import SimpleNamespace

from prefixd.daemon.config import AUTO_CACHE_MAX_BYTES_CPU, DaemonConfig
from prefixd.engine.runtime import kv_bytes_per_page, mem_available_bytes, plan_num_pages

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
            assert kernels is None if mode == "invariant" else set(kernels) == {"int4_product", "attention"}
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
