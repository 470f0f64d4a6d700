"""Compile the CUDA path's Triton kernels for a GPU on a machine without one.

`record_launches()` catches every Triton launch of prefixd's kernels (flash.py, fused.py,
kernels.py) while a forward runs, and keeps what a GPU launch would compile from: the kernel,
each argument's kind (a tensor's dtype and whether its address is 16-byte aligned, an int's
value, ...) and the launch options. The kernels are not run: their outputs stay as allocated,
which is enough to follow a round to its next launch.

`compile_launches(launches, archs)` compiles each distinct one for each NVIDIA architecture
(90: H100/H200, 80: A100, 89: Ada) in a child process without TRITON_INTERPRET (Triton's
interpreter replaces its language functions in the process that interprets), through
Triton's own argument binder, so the specializations are those a launch on that GPU picks;
each compile runs to a cubin with the ptxas Triton ships. It reports per launch and
architecture whether it compiled, the error otherwise, the shared memory it asks for, and
(ptxas -v) the registers a thread uses and the bytes it spills.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

# The modules and names of prefixd's Triton kernels.
KERNELS = (("prefixd.gpu.flash", "_flash_kernel"), ("prefixd.gpu.fused", "_rms_norm_kernel"),
           ("prefixd.gpu.fused", "_silu_mul_kernel"), ("prefixd.gpu.fused", "_rope_write_kernel"),
           ("prefixd.gpu.kernels", "_bmm_kernel"), ("prefixd.gpu.kernels", "_row_sum_kernel"))
# Shared memory a block may use, bytes (the opt-in maximum of each architecture)
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
ROOT = Path(__file__).resolve().parents[2]


def ptxas_available() -> bool:
    """Whether this Triton has its NVIDIA backend and ptxas (to build cubins without a GPU)."""
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "ptxas").is_file()


def _kind(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, bool) or value is None:
        return {"value": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, float):
        return {"float": value}
    raise TypeError(f"a Triton launch argument of type {type(value).__name__}")


@contextlib.contextmanager
def record_launches() -> Iterator[list[dict]]:
    """Every launch of prefixd's Triton kernels inside the block, not run, as a list of
    {"module", "kernel", "args", "kwargs"} (argument kinds, see `_kind`)."""
    import importlib

    launches: list[dict] = []

    class Recorder:
        def __init__(self, module: str, name: str) -> None:
            self.module, self.name = module, name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append({"module": self.module, "kernel": self.name, "args": [_kind(a) for a in args],
                                 "kwargs": {k: _kind(v) for k, v in kwargs.items()}})
            return launch

    with contextlib.ExitStack() as stack:
        for module, name in KERNELS:
            mod = importlib.import_module(module)
            original = getattr(mod, name)
            setattr(mod, name, Recorder(module, name))
            stack.callback(setattr, mod, name, original)
        yield launches


def distinct(launches: list[dict]) -> list[dict]:
    """The launches that differ in kernel, arguments' kinds or options (ints may differ in
    value and still compile alike: the child compiles each distinct specialization once)."""
    seen, out = set(), []
    for launch in launches:
        key = json.dumps(launch, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def compile_launches(launches: list[dict], archs: tuple[int, ...] = (90,), timeout: float = 900) -> list[dict]:
    """For each distinct launch (`distinct`), in order, {"kernel", "arch", "ok", "error",
    "shared", "registers", "spill_bytes", "constexprs", "key"} per architecture in `archs`,
    compiled in a child process; "key" names the compiled kernel (launches with one key run
    one binary)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "tests.helpers.triton_compile"], cwd=ROOT, env=env,
                          input=json.dumps({"archs": list(archs), "launches": distinct(launches)}),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the compiling process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def _value(kind: dict) -> Any:
    import torch

    if "tensor" in kind:
        dtype = getattr(torch, kind["tensor"])
        buf = torch.empty(64, dtype=dtype)
        return buf if kind["aligned"] else buf[1:]  # an element past an aligned start
    for key in ("int", "float", "value"):
        if key in kind:
            return kind[key]
    raise ValueError(f"argument kind {kind}")


def _compile_one(launch: dict, arch: int, cache: dict) -> dict:
    import hashlib
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    args = [_value(k) for k in launch["args"]]
    kwargs = {k: _value(v) for k, v in launch["kwargs"].items()}
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    named = {fn.params[path[0]].name: value for path, value in constexprs.items() if len(path) == 1}
    result = {"kernel": launch["kernel"], "arch": arch, "constexprs": {k: repr(v) for k, v in named.items()}}
    key = repr((launch["module"], launch["kernel"], arch, signature, constexprs, attrs, options))
    if key not in cache:  # launches whose ints differ but specialize alike compile once
        cache[key] = _build(fn, signature, constexprs, attrs, target, options)
    return {**result, **cache[key], "key": hashlib.sha256(key.encode()).hexdigest()[:16]}


def _build(fn, signature, constexprs, attrs, target, options) -> dict:
    import triton
    from triton.compiler import ASTSource

    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    except Exception as e:  # noqa: BLE001 - reported, the caller asserts
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:], "shared": None}
    if "cubin" not in compiled.asm:
        return {"ok": False, "error": "no cubin", "shared": None}
    return {"ok": True, "error": "", "shared": int(compiled.metadata.shared), **_ptxas_usage(compiled, target)}


def _ptxas_usage(compiled, target) -> dict:
    """Registers a thread and bytes it spills to local memory: ptxas -v on the kernel's PTX."""
    import re
    import tempfile

    import triton.backends.nvidia as nvidia

    arch = f"sm_{target.arch}a" if target.arch >= 90 else f"sm_{target.arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        log = subprocess.run([str(Path(nvidia.__file__).parent / "bin" / "ptxas"), "-v", "--gpu-name", arch, str(ptx),
                              "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return {"registers": int(registers.group(1)) if registers else None, "spill_bytes": sum(spills)}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("compile with TRITON_INTERPRET unset")
    request = json.load(sys.stdin)
    cache: dict = {}
    results = [_compile_one(launch, arch, cache) for launch in request["launches"] for arch in request["archs"]]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
