"""Text handling is plain Python: importing every module in prefixd.text loads no torch or cupy,
and none of them reaches into prefixd.gpu."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib, pkgutil, sys
import prefixd.text as pkg
names = sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cupy"))
gpu = sorted(m for m in sys.modules if m.startswith("prefixd.gpu"))
print(",".join(names), heavy, gpu)
"""


def test_text_imports_no_torch_cupy_or_gpu():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    names, heavy, gpu = out.stdout.strip().split(" ", 2)
    for module in ("chat", "chat_starts", "grammar", "tokenizer", "tokenizer_gguf", "tools"):
        assert f"prefixd.text.{module}" in names.split(",")
    assert heavy == "[]"
    assert gpu == "[]"
