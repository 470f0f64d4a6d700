#!/usr/bin/env bash
# CUDA check for a session that has a GPU machine, in one run of a few minutes:
#   1. what the libraries do: does cuBLAS / torch give a row other bits when the call has
#      other rows, batches or trailing zeros (a probe, printed, not a failure);
#   2. the cuda-marked tests (kernels.py's invariance, loading, dequantization, sampling,
#      copies, a runner round);
#   3. the exactness suites on CUDA (PREFIXD_TEST_DEVICE=cuda): chunked / one-at-a-time /
#      beside-7-lanes / verify invariance on tiny llama, qwen2, qwen3; the hybrid family's
#      exactness; the end-to-end daemon suites on the tiny models (resume, evict, 8 lanes);
#   4. a page-copy micro-benchmark, the plain-torch reference, the runtime table and the
#      daemon's socket aggregate against the in-process runtime, on a random model shaped like
#      the default one (the default GGUF is not on such machines).
#
#   bash bench/device_check.sh     # uses $PY, else the first python whose torch sees CUDA
#
# A machine without gguf, pytest-asyncio or the default model's tokenizer can be given them
# in .devcarry/: whl/*.whl (installed into a scratch dir) and tokenizer/ (tokenizer.json and
# chat_template.txt for the tiny test models; make it with `make devcarry`).
# Output also goes to $OUT/device_check.log when $OUT is set.
# Exit status: non-zero when a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "${OUT:-}" ]; then exec > >(tee "$OUT/device_check.log") 2>&1; fi

if compgen -G ".devcarry/whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/devcarry-site .devcarry/whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/devcarry-site"
fi
if [ -f .devcarry/tokenizer/tokenizer.json ]; then
  export PREFIXD_TEST_TOKENIZER_DIR="$PWD/.devcarry/tokenizer"
fi

pick_python() {
  for candidate in ${PY:-} .venv/bin/python python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 &&
      "$candidate" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if ! PYTHON=$(pick_python); then
  echo "device_check: no python with a CUDA-enabled torch found; nothing to check"
  exit 1
fi
failed=0
step() {  # step NAME SECONDS CMD...
  local name=$1 seconds=$2 start=$SECONDS
  shift 2
  echo "=== $name"
  timeout "$seconds" "$@"
  local rc=$?
  if [ "$rc" -ne 0 ]; then echo "=== $name FAILED (rc=$rc)"; failed=1; fi
  echo "=== $name: $((SECONDS - start)) s"
}
PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider -rfE --tb=short)

step "environment" 60 "$PYTHON" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
for name in ("cupy", "triton", "gguf", "pytest_asyncio", "transformers"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"))
    except ImportError:
        print(name, "not installed")
EOF

step "library invariance probe" 120 "$PYTHON" - <<'EOF'
import torch
import torch.nn.functional as F

def first_bad(full, part_fn, counts):
    bad = [m for m in counts if not torch.equal(part_fn(m), full[:m])]
    return "yes" if not bad else f"NO (row counts {bad[:6]})"

g = torch.Generator(device="cuda").manual_seed(0)
counts = [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 64, 65, 100, 128, 255, 256, 257, 511]
print("| op | dtype | shape | a row's bits independent of the call |")
print("|---|---|---|---|")
for dtype in (torch.bfloat16, torch.float32):
    for k, n in ((576, 1728), (1536, 576), (576, 49152)):
        x = torch.randn(512, k, device="cuda", generator=g).to(dtype)
        w = torch.randn(n, k, device="cuda", generator=g).to(dtype)
        full = F.linear(x, w)
        print(f"| F.linear (cuBLAS) | {dtype} | {k}->{n} | {first_bad(full, lambda m: F.linear(x[:m], w), counts)} |")
    q = torch.randn(384, 24, 64, device="cuda", generator=g).to(dtype)
    kk = torch.randn(384, 256, 64, device="cuda", generator=g).to(dtype)
    s = torch.bmm(q, kk.transpose(1, 2))
    print(f"| torch.bmm (cuBLAS) | {dtype} | batches x 24x64 @ 64x256 | "
          f"{first_bad(s, lambda b: torch.bmm(q[:b], kk[:b].transpose(1, 2)), [1, 2, 3, 6, 12, 48, 96, 200])} |")
x = torch.randn(512, 576, device="cuda", generator=g)
full = x.pow(2).mean(-1)
print(f"| mean over 576 | fp32 | rows | {first_bad(full, lambda m: x[:m].pow(2).mean(-1), counts)} |")
st = torch.randn(8, 16, 128, 128, device="cuda", generator=g)
many = st.sum(dim=-2)
print(f"| sum over dim -2 | fp32 | (B,16,128,128) | {first_bad(many, lambda b: st[:b].sum(dim=-2), [1, 2, 3, 4, 7])} |")
EOF

step "pytest -m cuda" 240 "${PYTEST[@]}" -m cuda tests/gpu

step "exactness suites on cuda" 300 env PREFIXD_TEST_DEVICE=cuda "${PYTEST[@]}" -m "not slow" \
  tests/gpu/test_flash.py tests/gpu/test_fused.py tests/gpu/test_programs.py tests/gpu/test_programs_hybrid.py tests/gpu/test_invariance.py tests/gpu/test_hybrid_exact.py tests/gpu/test_hybrid_runner.py \
  tests/e2e/test_e2e_hybrid.py tests/e2e/test_e2e_concurrent.py tests/e2e/test_e2e_basic.py

# drafted = undrafted (n-gram on tiny llama, qwen3, qwen3_5; MTP on qwen3_5): issue 11's suites
step "drafting suites on cuda" 180 env PREFIXD_TEST_DEVICE=cuda "${PYTEST[@]}" \
  tests/scheduler/test_engine_drafts.py tests/scheduler/test_engine_mtp_drafts.py tests/gpu/test_hybrid_mtp_drafts.py

step "page-copy micro-benchmark" 90 "$PYTHON" - <<'EOF'
import time
import torch
from prefixd.gpu.copy import CopyEngine

device = torch.device("cuda")
# 60 pools like a 30-layer KV (K and V), 512 pages of 16 rows x 3 heads x 64 dims, bf16.
pools = [torch.randn(512, 16, 3, 64, device=device).to(torch.bfloat16) for _ in range(60)]
src, dst = list(range(0, 128)), list(range(256, 384))
for use_cupy in (True, False):
    try:
        engine = CopyEngine(device, use_cupy=use_cupy)
    except ValueError as exc:
        print(f"use_cupy={use_cupy}: {exc}")
        continue
    engine.copy_pages(pools, src, dst).wait()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        fence = engine.copy_pages(pools, src, dst)
    engine.wait_all()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 20
    print(f"use_cupy={use_cupy}: {fence.nbytes / 2**20:.1f} MiB per batch, "
          f"{fence.nbytes / seconds / 1e9:.1f} GB/s")
EOF

step "plain-torch reference, same shape (eager SDPA prefill, decode in one CUDA graph)" 120 \
  "$PYTHON" bench/torch_reference.py --repeats 3

SHAPED=$(mktemp -d)/smollm2-shaped  # a random model shaped like the default one
step "random model shaped like the default" 60 "$PYTHON" - "$SHAPED" <<'EOF'
import sys
from tests.helpers.tiny_models import make_tiny_hf_dir
make_tiny_hf_dir(sys.argv[1], "llama", seed=0, dtype="bfloat16", hidden_size=576, intermediate_size=1536,
                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                 max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
EOF

step "runtime table on cuda (that model)" 240 \
  "$PYTHON" bench/runtime.py --device cuda --model "$SHAPED" --no-llama-cpp --repeats 3

# the daemon (graphs and overlap: CUDA's defaults) against the in-process runtime, 8 clients
step "daemon on cuda: 8 socket clients against the in-process runtime (that model)" 180 \
  "$PYTHON" bench/daemon.py --device cuda --model "$SHAPED" --pairs 3

exit "$failed"
