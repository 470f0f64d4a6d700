#!/usr/bin/env bash
# CUDA check for a session that has a GPU machine: the cuda-marked tests, a page-copy
# micro-benchmark and a quick runtime table on the GPU. Finishes in a few minutes.
#
#   bash bench/device_check.sh            # uses $PY, else the first python whose torch sees CUDA
#
# Exit status: non-zero when a step failed (a step with nothing to run is not a failure).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

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
  local name=$1 seconds=$2
  shift 2
  echo "=== $name"
  timeout "$seconds" "$@"
  local rc=$?
  if [ "$rc" -eq 5 ] && [ "$name" = "pytest -m cuda" ]; then rc=0; fi  # no cuda tests collected
  if [ "$rc" -ne 0 ]; then echo "=== $name FAILED (rc=$rc)"; failed=1; fi
}

step "environment" 60 "$PYTHON" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
try:
    import cupy
    print("cupy", cupy.__version__)
except ImportError:
    print("cupy: not installed (page copies use torch ops on the copy stream)")
EOF

step "pytest -m cuda" 300 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider tests/gpu

step "page-copy micro-benchmark" 120 "$PYTHON" - <<'EOF'
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

step "runtime bench --quick on cuda" 240 "$PYTHON" bench/runtime.py --quick --device cuda --no-llama-cpp

exit "$failed"
