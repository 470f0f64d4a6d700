"""The scheduler is plain Python: importing it and every module in it loads no torch or cupy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib, pkgutil, sys
import prefixd.scheduler as pkg
names = [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cupy"))
print(len(names), heavy)
"""


def test_scheduler_imports_no_torch_or_cupy():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    count, heavy = out.stdout.strip().split(" ", 1)
    assert int(count) >= 8  # engine, lanes, admission, rounds, streams, observer, config, planner, store...
    assert heavy == "[]"


def test_the_disk_tier_imports_no_torch_or_cupy():
    """Its writer thread must run no torch op; importing it must not even load torch."""
    probe = PROBE.replace("prefixd.scheduler as pkg", "prefixd.disk as pkg")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    count, heavy = out.stdout.strip().split(" ", 1)
    assert int(count) >= 5  # format, identity, index, tier, writer
    assert heavy == "[]"
