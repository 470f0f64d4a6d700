"""Builds what `serve` runs: checkpoint -> ModelRunner (the Device) -> Engine, plus the tokenizer.

The daemon only wires: loading and compute live in `prefixd.gpu`, scheduling in
`prefixd.scheduler`. torch objects are made by `prefixd.gpu` from the config's strings.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from prefixd.daemon.config import AUTO_CACHE_MAX_BYTES_CPU, DaemonConfig, resolve_draft
from prefixd.daemon.options import KV_MEMORY_FRACTION
from prefixd.engine.sampling_defaults import sampling_defaults
from prefixd.daemon.startup import StartupError

log = logging.getLogger("prefixd.runtime")
FRONT_PID_ENV = "PREFIXD_FRONT_PID"  # set for the engine process by the front that starts it
_DTYPE_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True, slots=True)
class Runtime:
    """A loaded model ready to serve: the engine (single-threaded), its tokenizer, a summary."""

    engine: Any  # prefixd.scheduler.engine.Engine
    tokenizer: Any  # prefixd.text.tokenizer.Tokenizer
    model_info: dict[str, Any]
    decoder_factory: Callable[[], Any] | None = None  # None: prefixd.text.tokenizer.StreamDecoder
    disk: Any = None  # prefixd.disk.tier.DiskTier, or None when the disk tier is off
    before_round: Callable[[], Any] | None = None  # before each round, where it runs: the CPU thread policy
    overlap: bool = False  # rounds run on a device thread beside the engine's host work (engine/process.py)
    device_status: Callable[[], dict[str, Any]] | None = None  # what status adds of the device, between rounds


def plan_num_pages(cfg: DaemonConfig, *, kv_bytes_per_page: int, max_context: int,
                   available_bytes: int | None) -> int:
    """KV pool pages: every lane can reach `max_context`, plus the pages the cache may hold.

    With an explicit --cache-budget the store gets budget // page bytes pages; with `auto`
    it gets KV_MEMORY_FRACTION of `available_bytes` (memory left after loading: host RAM,
    at most AUTO_CACHE_MAX_BYTES_CPU, or free device memory) minus the lanes' pages, and
    without that figure as many pages again as the lanes reserve.
    """
    lane_pages = cfg.num_lanes * math.ceil(max_context / cfg.page_size)
    if not cfg.cache:
        return lane_pages
    if cfg.cache_budget_bytes is not None:
        store_pages = cfg.cache_budget_bytes // kv_bytes_per_page
    elif available_bytes is not None:
        spare = int(available_bytes * KV_MEMORY_FRACTION) - lane_pages * kv_bytes_per_page
        if cfg.device == "cpu":
            spare = min(spare, AUTO_CACHE_MAX_BYTES_CPU)
        store_pages = max(0, spare // kv_bytes_per_page)
    else:
        store_pages = lane_pages
    return lane_pages + store_pages


def lanes_fit_context(cfg: DaemonConfig, *, kv_bytes_per_page: int, available_bytes: int | None) -> int | None:
    """The longest context, in whole pages, whose KV every lane can reserve up front within
    KV_MEMORY_FRACTION of `available_bytes` (lanes x context x KV bytes per row); None where
    that figure is not known. At least one page."""
    if available_bytes is None:
        return None
    pages_per_lane = int(available_bytes * KV_MEMORY_FRACTION) // (cfg.num_lanes * kv_bytes_per_page)
    return max(1, pages_per_lane) * cfg.page_size


def context_line(cfg: DaemonConfig, *, max_context: int, model_max_context: int, kv_bytes_per_page: int,
                 available_bytes: int | None) -> str:
    """The start-up line saying which context the daemon serves and why."""
    lanes_bytes = cfg.num_lanes * math.ceil(max_context / cfg.page_size) * kv_bytes_per_page
    reserved = f"{cfg.num_lanes} lanes x {max_context} rows of KV take {_size(lanes_bytes)}"
    if cfg.max_context is not None:
        return f"context {max_context} tokens (--max-context); {reserved}"
    if max_context >= model_max_context:
        return f"context {max_context} tokens (the model's); {reserved}"
    memory = "RAM" if cfg.device == "cpu" else "device memory"
    share = int((available_bytes or 0) * KV_MEMORY_FRACTION)
    return (f"context {max_context} tokens (the model's is {model_max_context}): {cfg.num_lanes} lanes x context "
            f"KV must fit in {_size(share)} ({KV_MEMORY_FRACTION:.0%} of the {_size(available_bytes or 0)} of "
            f"{memory} left); --max-context raises it (fewer --lanes lengthen it)")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB" if num_bytes >= 1 << 30 else f"{num_bytes / (1 << 20):.1f} MiB"


def kv_bytes_per_page(model_config: Any, cfg: DaemonConfig, mode: str = "invariant") -> int:
    """K and V of one page for every layer (an upper bound for families with fewer KV layers):
    mode int4's 8-bit pages hold a byte a dim and a 4-byte scale per 32 dims (kv_pool.py)."""
    from prefixd.gpu.kv_pool import kv_pages

    d = model_config.head_dim
    per_head = d + d // 8 if kv_pages(mode, d).get("codes8") else d * _DTYPE_BYTES[cfg.dtype]
    return 2 * model_config.num_layers * model_config.num_kv_heads * per_head * cfg.page_size


def mtp_layers(model_config: Any) -> int:
    """Multi-token-prediction layers the checkpoint ships (qwen3_5 only; 0 for the others)."""
    return int(getattr(model_config.extra.get("hybrid"), "num_mtp_layers", 0))


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_factory(cfg: DaemonConfig, observer: Any) -> Runtime:
    """The engine process's factory: `load_runtime` with the load's progress on stderr."""
    from prefixd.gpu.loading import stderr_progress

    return load_runtime(cfg, observer=observer, progress=stderr_progress())


def load_runtime(cfg: DaemonConfig, *, observer: Any,
                 progress: Callable[[str, int, int], None] | None = None) -> Runtime:
    """Load the model named by `cfg.model` and build the engine around it (blocking)."""
    from prefixd.gpu.backend import free_device_bytes, resolve
    from prefixd.gpu.families import resolve_mode
    from prefixd.gpu.kernels import RowVarianceError, check_cpu_products
    from prefixd.gpu.loading import load_checkpoint
    from prefixd.gpu.runner import ModelRunner
    from prefixd.gpu.threads import CpuThreads
    from prefixd.scheduler.engine import Engine

    device, dtype = resolve(cfg.device, cfg.dtype)
    if device.type == "cpu":  # before the load: a CPU whose products break row invariance is refused at once
        try:
            check_cpu_products()
        except RowVarianceError as e:
            raise StartupError(str(e)) from None
    checkpoint = load_checkpoint(cfg.model, device=device, dtype=dtype, progress=progress)
    mode = resolve_mode(cfg.mode, checkpoint.config.family, device, dtype)  # the disk tier keys on it
    page_bytes = kv_bytes_per_page(checkpoint.config, cfg, mode)
    available = mem_available_bytes() if cfg.device == "cpu" else free_device_bytes(device)
    model_max_context = checkpoint.config.max_context
    max_context = cfg.resolved_max_context(
        model_max_context, lanes_fit_context(cfg, kv_bytes_per_page=page_bytes, available_bytes=available))
    if cfg.max_context is not None and cfg.max_context > model_max_context:
        log.warning("--max-context %d is above the model's limit of %d tokens; using %d",
                    cfg.max_context, model_max_context, max_context)
    log.info("%s", context_line(cfg, max_context=max_context, model_max_context=model_max_context,
                                kv_bytes_per_page=page_bytes, available_bytes=available))
    num_pages = plan_num_pages(cfg, kv_bytes_per_page=page_bytes, max_context=max_context, available_bytes=available)
    draft = resolve_draft(cfg.draft, checkpoint.config.family, mode, draft_head=mtp_layers(checkpoint.config) > 0)
    if draft == "mtp" and not mtp_layers(checkpoint.config):
        raise StartupError(f"--draft mtp: {checkpoint.path} has no MTP (multi-token prediction) layers; "
                           "use --draft ngram or --draft off")
    runner = ModelRunner(checkpoint, device=device, dtype=dtype, num_lanes=cfg.num_lanes,
                         num_pages=num_pages, page_size=cfg.page_size, mode=mode, draft_head=draft == "mtp",
                         programs=cfg.cuda_graphs)
    sched = cfg.scheduler_config(max_context=max_context, draft=draft)
    disk = build_disk_tier(cfg, checkpoint.path, runner, device.type, observer) if cfg.cache else None
    engine = Engine(runner, sched, observer=observer, disk=disk)
    info = runner.info
    overlap = cfg.overlap == "on" or (cfg.overlap == "auto" and device.type == "cuda")
    model_info = {
        "name": Path(str(checkpoint.path)).name,
        "source": checkpoint.source,
        "family": checkpoint.config.family,
        "vocab_size": info.vocab_size,
        "hidden_size": checkpoint.config.hidden_size,
        "max_context": engine.max_context,
        "device": cfg.device,
        "dtype": cfg.dtype,
        "mode": runner.model.mode,
        # mode int4's CPU kernels: the path each takes on this CPU (the bits are the same on all)
        "cpu_kernels": cpu_kernel_paths(runner.kv.codes8) if runner.model.mode == "int4" else None,
        "draft": sched.draft,
        "draft_chosen_by": "auto" if cfg.draft == "auto" else "flag",
        # the captured decode programs (gpu/programs.py): None on the CPU and with --cuda-graphs off
        "cuda_graphs": runner.programs.status() if runner.programs is not None else None,
        "overlap": overlap,
        "lanes": cfg.num_lanes,
        "page_size": info.page_size,
        "num_pages": info.num_pages,
        "weights_bytes": info.weights_bytes,
        "sampling_defaults": sampling_defaults(Path(str(checkpoint.path)), checkpoint.source),
    }
    # the front process's CPU (renders, encodes, replies) is the daemon's own, as it was when
    # both were one process: the team does not shrink for it (engine/process.py names the pid)
    front = tuple(int(p) for p in os.environ.get(FRONT_PID_ENV, "").split() if p.isdigit())
    threads = CpuThreads.up_to_current(also_own=front) if cfg.device == "cpu" else None
    return Runtime(engine=engine, tokenizer=runner.tokenizer, model_info=model_info, disk=disk,
                   before_round=None if threads is None else threads.tick, overlap=overlap,
                   device_status=lambda: {"decode_programs": len(runner.programs.programs)
                                          if runner.programs is not None else None})


def cpu_kernel_paths(codes8: bool) -> dict[str, str]:
    """The paths mode int4's kernels take here, and the pool's page kind (8-bit pages, or bf16
    where the head width is not a multiple of 32): what `status` shows as `model.cpu_kernels`."""
    from prefixd.gpu import cpu_kernels

    return {"int4_product": cpu_kernels.isa(), "attention": cpu_kernels.attention_path(q8=codes8),
            "kv_pages": "8-bit" if codes8 else "bf16"}


def build_disk_tier(cfg: DaemonConfig, model_path: Any, runner: Any, device_kind: str, observer: Any) -> Any:
    """The disk tier in `cfg.disk_cache_dir`, or None when it is off or cannot be opened (a
    warning: the daemon serves from RAM)."""
    if cfg.disk_cache_dir is None or cfg.disk_budget_bytes <= 0:
        if cfg.shared_cache_url:
            log.warning("shared cache off: it needs the disk tier (--disk-cache, --disk-budget)")
        return None
    from prefixd.disk.identity import model_content_hash
    from prefixd.disk.tier import DiskTier
    from prefixd.gpu.families import mode_identity
    from prefixd.disk.index import TierIdentity

    info = runner.info
    try:
        identity = TierIdentity(
            model_hash=model_content_hash(Path(str(model_path)), cfg.disk_cache_dir), dtype=cfg.dtype,
            device_kind=device_kind, mode=mode_identity(runner.mode), page_size=info.page_size,
            kv_bytes_per_page=info.kv_bytes_per_page, lane_state_bytes=info.lane_state_bytes,
            logits_row_bytes=info.logits_row_bytes, lookahead=info.lookahead, invariant_rows=info.invariant_rows)
        tier = DiskTier(cfg.disk_cache_dir, identity, budget_bytes=cfg.disk_budget_bytes, observer=observer)
    except OSError as e:
        log.warning("disk cache off: cannot use %s: %s; serving from RAM", cfg.disk_cache_dir, e)
        return None
    tier.shared = build_shared_tier(cfg.shared_cache_url, identity)
    return tier


def build_shared_tier(url: str, identity: Any) -> Any:
    """The shared tier at `url` (prefixd.disk.shared), or None when `url` is empty or unusable
    (a warning: the daemon caches locally)."""
    if not url:
        return None
    from prefixd.disk.shared import SharedConfig, SharedTier

    try:
        shared = SharedTier(SharedConfig.parse(url), identity)
    except (ValueError, ImportError) as e:
        log.warning("shared cache off: %s; caching locally", e)
        return None
    log.info("shared cache: %s (entries expire %g s after their last use)", url, shared.config.ttl_s)
    return shared
