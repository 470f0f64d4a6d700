"""GPU/CPU runtime: the only package that imports torch.

Before anything here imports torch, oneDNN (torch's CPU library for bf16 products) is capped
at AVX-512 BF16 instructions: on CPUs with AMX it otherwise picks AMX kernels by a call's
row count, and a row's bits then follow the round (docs/runtime.md, *Threads and library
products*). oneDNN reads the cap once, at its first product in the process, so it must be set
before any bf16 product runs; `kernels.check_cpu_products` verifies it when a CPU runner is
built. A user's own ONEDNN_MAX_CPU_ISA is kept (and checked the same way).
"""

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
