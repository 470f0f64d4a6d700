from __future__ import annotations

import pytest

from tests.scheduler.engines import ENGINES


@pytest.fixture(autouse=True)
def _integrity_after_each_test():
    ENGINES.clear()
    yield
    for engine in ENGINES:
        engine.check_integrity()
