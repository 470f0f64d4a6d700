"""glibc heap policy for the daemon's two processes (no-ops where the C library is not glibc).

- `one_malloc_arena`: every thread allocates from the main heap. A worker thread's own arena
  (a render or an encode in the front, the disk writer in the engine) keeps its freed top
  resident for good, out of a trim's reach; with one arena the idle trim returns it.
  Call it before the process starts threads.
- `retain_freed_memory` (the engine): keep freed heap for the next round instead of handing
  it back and faulting it in again page by page.
- `return_idle_memory`: collect cyclic garbage, then hand freed heap back (an idle spell).
- `trim_heap`: hand freed heap back (a front's heavy worker, after each job).
- `freeze_loaded_heap`: move what a process has loaded out of the cyclic collector's reach.
"""

from __future__ import annotations

import ctypes
import gc

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc mallopt parameters (malloc.h)
RETAINED_FREE_BYTES = 1 << 30  # free heap kept before malloc gives memory back to the kernel
IDLE_TRIM_S = 5.0  # idle time after which a process hands its freed heap back, once per idle spell


def _mallopt(param: int, value: int) -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(param, value))


def one_malloc_arena() -> bool:
    """Make every thread of this process allocate from glibc's main heap; False, changing
    nothing, where the C library has no mallopt."""
    return _mallopt(_M_ARENA_MAX, 1)


def retain_freed_memory() -> bool:
    """Keep up to RETAINED_FREE_BYTES of freed heap, and no block in a mapping of its own.
    Process-wide; False, changing nothing, where the C library has no mallopt."""
    return _mallopt(_M_TRIM_THRESHOLD, RETAINED_FREE_BYTES) and _mallopt(_M_MMAP_MAX, 0)


def return_idle_memory() -> None:
    """Collect cyclic garbage, then hand freed heap back to the system (glibc's malloc_trim)."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Hand freed heap back to the system (glibc's malloc_trim; a no-op elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def freeze_loaded_heap() -> None:
    """Collect once, then move every object alive now (modules, the tokenizer, the model's
    Python side) out of the cyclic collector's reach, for the process's life: a full
    collection then walks only what serving allocated since. Unfrozen, a gen-2 collection
    walked ~200,000 objects and held the GIL for 63-81 ms, and every round in flight waited for
    it (docs/benchmarks.md, *Soak*). Process-wide: the front and the engine process each call
    it once, after their load."""
    gc.collect()
    gc.freeze()
