"""The scheduler's enumerations are the strings the wire and the metrics carry: a value added
or renamed on one side only fails here, not in a client."""

from __future__ import annotations

from typing import get_args

import pytest

from prefixd.ipc import events as wire
from prefixd.metrics import collectors
from prefixd.scheduler.config import DRAFT_MODES, SchedulerConfig
from prefixd.scheduler.records import CacheResult, DraftMode, FinishReason


def test_cache_results_are_the_wires_and_the_metrics_labels():
    assert get_args(CacheResult) == wire.CACHE_RESULTS == collectors.CACHE_RESULTS


def test_finish_reasons_are_the_metrics_labels_and_the_wire_adds_only_tool_calls():
    assert get_args(FinishReason) == collectors.FINISH_REASONS
    assert wire.FINISH_REASONS == (*get_args(FinishReason), "tool_calls")  # a front's, from its output


def test_the_config_takes_exactly_the_draft_modes():
    assert DRAFT_MODES == {"mtp", "ngram", "off"} == set(get_args(DraftMode))
    for mode in get_args(DraftMode):
        assert SchedulerConfig(draft=mode).draft == mode
    with pytest.raises(ValueError, match="draft must be one of"):
        SchedulerConfig(draft="auto")  # type: ignore[arg-type]  # the daemon resolves auto first
