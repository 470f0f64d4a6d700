"""Every Triton launch a CUDA round makes compiles for the GPUs prefixd targets, on any machine.

The CPU tests run the CUDA path's kernels through Triton's interpreter, which executes them
with numpy: it does not check what the GPU compiler checks (loop-carried types, layouts,
dot shapes, shared memory). Here a CPU runner is sent down the CUDA path (`_use_triton`:
the projections too) with the kernels recorded instead of run (tests/helpers/
triton_compile.py), for each model shape and dtype the suites use, the default model's shape
and 128- and 256-wide heads included, through prefill, verify and decode rounds and decode programs;
each distinct launch is then compiled for an H100/H200 (sm_90) and an A100 (sm_80) to a
cubin with the ptxas Triton ships, with the specialization Triton's binder picks on a GPU;
none may spill registers (ptxas -v), and its shared memory is held against the smallest limit
of the GPUs it may run on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefixd.gpu import flash, kernels
from prefixd.scheduler.records import RoundPlan
from tests.gpu.runner_helpers import lane_pages, make_runner, prompt, work
from tests.helpers import triton_compile
from tests.helpers.tiny_models import make_tiny_hf_dir, make_tiny_hybrid_hf_dir

pytestmark = [
    pytest.mark.skipif(not kernels.triton_available() or not triton_compile.ptxas_available(),
                       reason="needs Triton with its NVIDIA backend (ptxas)"),
    pytest.mark.skipif(not flash.INTERPRETING, reason="records launches on the CPU (TRITON_INTERPRET=1)"),
]
CPU = torch.device("cpu")
ARCHS = (90, 80)
# The smallest shared memory of the GPUs an architecture's cubin runs on (sm_80's runs on
# sm_86/89 too: 99 KB a block there).
SHARED_BUDGET = 99 * 1024


def _default_shaped(path: Path) -> Path:
    """One layer of the default model's shape: 576 wide, 9 q heads over 3 kv heads of 64, MLP 1536."""
    return make_tiny_hf_dir(path, "llama", seed=4, tie_word_embeddings=True, hidden_size=576,
                            intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                            num_key_value_heads=3, head_dim=64)


def _wide_heads(path: Path) -> Path:
    """qwen3 (q/k norms) with heads of 128 (GQA 4 over 2): the widest head the kernels take."""
    return make_tiny_hf_dir(path, "qwen3", seed=6, head_dim=128, num_hidden_layers=1)


MODELS = {
    "llama": lambda p: make_tiny_hf_dir(p, "llama", seed=1, tie_word_embeddings=True),
    "qwen2": lambda p: make_tiny_hf_dir(p, "qwen2", seed=2),
    "default-shape": _default_shaped,
    "head-128": _wide_heads,
    "hybrid": lambda p: make_tiny_hybrid_hf_dir(p, seed=9, vocab_size=49152, initializer_range=0.1),
    # the hybrid family's real attention heads are 256 wide
    "hybrid-head-256": lambda p: make_tiny_hybrid_hf_dir(p, seed=9, vocab_size=49152, initializer_range=0.1,
                                                         head_dim=256),
}
CASES = [("llama", torch.bfloat16), ("llama", torch.float32), ("qwen2", torch.bfloat16),
         ("default-shape", torch.bfloat16), ("head-128", torch.bfloat16), ("hybrid", torch.bfloat16),
         ("hybrid", torch.float32), ("hybrid-head-256", torch.bfloat16)]


def _rounds(runner) -> None:
    """Prefill of two lanes, then a round of decode and verify rows (1, 3 and 5 rows a lane)."""
    runner.run_round(RoundPlan((work(0, 0, prompt(40), lane_pages(0)), work(1, 0, prompt(17), lane_pages(1)))))
    runner.run_round(RoundPlan((work(0, 40, prompt(1), lane_pages(0), prefill=False),
                                work(1, 17, prompt(3), lane_pages(1), prefill=False),
                                work(2, 0, prompt(5), lane_pages(2), prefill=False))))


def _down_the_cuda_path(mp: pytest.MonkeyPatch) -> None:
    """A CPU runner's forward takes the CUDA path, with the launch options a GPU gets."""
    mp.setattr(kernels, "TRITON_ON_CPU", True)
    mp.setattr(kernels, "_use_triton", lambda x: True)  # the projections and sums too
    mp.setattr(kernels, "_cpu_products_checked", True)  # its probe would read unrun kernels' outputs
    mp.setattr(flash, "INTERPRETING", False)  # bf16 attention on the tensor cores, not the interpreter's form


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> list[dict]:
    """Every launch of the CASES' rounds, eager and through decode programs, on the CUDA path."""
    recorded: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        _down_the_cuda_path(mp)
        dirs = {}
        for name, dtype in CASES:
            if name not in dirs:
                dirs[name] = MODELS[name](tmp_path_factory.mktemp(f"compile-{name}"))
            for programs in ("off", "eager"):
                runner = make_runner(dirs[name], dtype, device=CPU, programs=programs)
                with triton_compile.record_launches() as got:
                    _rounds(runner)
                assert got, f"{name} {dtype} ({programs}) launched no Triton kernel"
                recorded += got
    return recorded


@pytest.fixture(scope="module")
def compiled(launches) -> list[dict]:
    return triton_compile.compile_launches(launches, ARCHS)


def test_every_kernel_is_launched(launches):
    """The recording reaches each kernel (a launch site that stopped calling one would leave it
    unchecked): attention, the norm, rope with its K/V write, SiLU times up and the products."""
    names = {launch["kernel"] for launch in launches}
    assert names >= {"_flash_kernel", "_rms_norm_kernel", "_silu_mul_kernel", "_rope_write_kernel", "_bmm_kernel"}


def test_bf16_attention_compiles_for_the_tensor_cores(compiled):
    """A bf16 pool's attention takes bf16 operands on the GPU (F32_DOT is the interpreter's
    and fp32 pools' form): the recording saw the options a GPU launch gets."""
    flashes = [r for r in compiled if r["kernel"] == "_flash_kernel"]
    assert {r["constexprs"]["F32_DOT"] for r in flashes} == {"False", "True"}
    assert {r["constexprs"]["HEAD_DIM"] for r in flashes} >= {"16", "64", "128", "256"}


def test_every_launch_compiles_for_sm90_and_sm80(compiled):
    failed = [f"{r['kernel']} sm_{r['arch']} {r['constexprs']}: {r['error']}" for r in compiled if not r["ok"]]
    assert not failed, "\n\n".join(failed)
    assert {r["arch"] for r in compiled} == set(ARCHS)


def test_no_launch_spills_registers(compiled):
    """Registers spilled to local memory cost a round memory traffic it does not need (the
    flash kernel spilled ~1 KB a thread for 256-wide heads at 64 keys a step: flash.block_n)."""
    spilled = [f"{r['kernel']} sm_{r['arch']} {r['constexprs']}: {r['spill_bytes']} bytes, {r['registers']} registers"
               for r in compiled if r["ok"] and r["spill_bytes"]]
    assert not spilled, "register spills:\n" + "\n".join(spilled)


def test_shared_memory_fits_every_target(compiled):
    over = [f"{r['kernel']} sm_{r['arch']} {r['constexprs']}: {r['shared']} bytes" for r in compiled
            if r["ok"] and r["shared"] > min(SHARED_BUDGET, triton_compile.SHARED_LIMIT[r["arch"]])]
    assert not over, "shared memory over budget:\n" + "\n".join(over)



def test_a_round_of_any_row_count_runs_kernels_already_compiled(tmp_path, monkeypatch):
    """Triton compiles another binary for an int argument equal to 1 or a multiple of 16
    unless told not to, and a new binary is seconds of compiling in the middle of serving.
    Row counts change from round to round, so every kernel leaves them unspecialized: rounds
    of 1, 16, 17 and 40 prefill rows, a decode row, and two lanes of 3 verify rows run the
    same compiled kernels (sm_90)."""
    _down_the_cuda_path(monkeypatch)
    runner = make_runner(MODELS["llama"](tmp_path), torch.bfloat16, device=CPU, programs="off")
    rounds = [RoundPlan((work(0, 0, prompt(1), lane_pages(0)),)), RoundPlan((work(1, 0, prompt(16), lane_pages(1)),)),
              RoundPlan((work(2, 0, prompt(17), lane_pages(2)),)), RoundPlan((work(3, 0, prompt(40), lane_pages(3)),)),
              RoundPlan((work(0, 1, prompt(1), lane_pages(0), prefill=False),)),
              RoundPlan((work(1, 16, prompt(3), lane_pages(1), prefill=False),
                         work(2, 17, prompt(3), lane_pages(2), prefill=False)))]
    recorded = []
    for plan in rounds:
        with triton_compile.record_launches() as got:
            runner.run_round(plan)
        recorded.append(got)
    every = [launch for got in recorded for launch in got]
    key = {json.dumps(launch, sort_keys=True): result["key"]
           for launch, result in zip(triton_compile.distinct(every), triton_compile.compile_launches(every, (90,)))}
    binaries = [{key[json.dumps(launch, sort_keys=True)] for launch in got} for got in recorded]
    assert all(b == binaries[0] for b in binaries), \
        f"binaries a round compiled that the first round did not, per round: {[sorted(b - binaries[0]) for b in binaries]}"
