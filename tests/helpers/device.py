"""The device the exactness suites run on: `PREFIXD_TEST_DEVICE=cuda` runs the runner,
hybrid and end-to-end suites on a GPU (bench/device_check.sh does); the default is the CPU."""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("PREFIXD_TEST_DEVICE", "cpu")
