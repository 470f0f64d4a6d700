"""How the engine process's OpenMP threads wait: set by the front, which starts it.

libgomp reads its settings once, when torch loads it, so they go into the engine process's
environment. A team member waiting at a barrier, or for the next parallel region, spins
GOMP_SPINCOUNT pause-loop turns before it sleeps. libgomp's own default is ~300,000 turns
(7-8 ms on the project's machines, where 2,000 take ~50 µs): between rounds the engine's second
thread then held a core the front and the clients needed, and while the kernel had one member
off its core its partner spun at every barrier of the round (docs/benchmarks.md, *2026-12-07:
the engine's OpenMP threads spin briefly*). Torch-free: the front imports it.
"""

from __future__ import annotations

from typing import Mapping

ENGINE_SPIN_COUNT = 2000


def engine_omp_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the engine process's environment adds to `environ`: a short spin, unless
    `environ` already chooses a wait policy or a spin count (the user's choice stands)."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": str(ENGINE_SPIN_COUNT)}
