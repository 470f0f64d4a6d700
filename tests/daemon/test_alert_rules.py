"""The shipped Prometheus alert rules pass `promtool check rules` and their own unit tests
(deploy/prometheus/prefixd-alerts.test.yml: each alert fires on the series it is for, and not
before its `for:` nor on a steady daemon beside it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="no `promtool` on PATH (apt install prometheus)")


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120)


def test_alert_rules_are_valid():
    out = _promtool("check", "rules", "prefixd-alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 4 rules found" in out.stdout + out.stderr


def test_alert_rules_pass_their_unit_tests():
    out = _promtool("test", "rules", "prefixd-alerts.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
