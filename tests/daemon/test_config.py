"""DaemonConfig from flags and environment."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prefixd.daemon.config import ConfigError, DaemonConfig, config_from_args, resolve_draft


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**kw)


def test_defaults_without_flags_or_env():
    cfg = config_from_args(_args(), env={"HOME": "/home/u"})
    assert cfg == DaemonConfig(disk_cache_dir=Path("/home/u/.cache/prefixd"))
    assert cfg.num_lanes == 8
    assert cfg.metrics_addr == "127.0.0.1:9464"
    assert cfg.resolved_max_context(8192) == 8192  # the model's, on the CPU too
    assert cfg.resolved_max_context(8192, lanes_fit=5824) == 5824  # at most what the lanes' KV fits
    assert cfg.resolved_max_context(8192, lanes_fit=16384) == 8192


def test_an_explicit_max_context_wins_over_the_memory_bound_but_not_the_model():
    cfg = config_from_args(_args(max_context=9000), env={})
    assert cfg.resolved_max_context(8192, lanes_fit=1024) == 8192
    assert cfg.resolved_max_context(16384, lanes_fit=1024) == 9000


def test_flags_win_over_env_and_env_fills_the_rest():
    env = {"PREFIXD_LANES": "2", "PREFIXD_SOCKET": "/env.sock", "PREFIXD_DTYPE": "fp32"}
    cfg = config_from_args(_args(lanes=3, no_cache=True, cache_budget="1GiB", metrics_addr=""), env=env)
    assert cfg.lanes == 3
    assert cfg.socket_path == Path("/env.sock")
    assert cfg.dtype == "fp32"
    assert cfg.cache is False
    assert cfg.cache_budget_bytes == 1 << 30
    assert cfg.metrics_addr == ""


@pytest.mark.parametrize("env, flag, expected", [
    ({"STATE_DIRECTORY": "/var/lib/prefixd:/var/lib/other", "XDG_CACHE_HOME": "/x"}, None, "/var/lib/prefixd"),
    ({"XDG_CACHE_HOME": "/x", "HOME": "/home/u"}, None, "/x/prefixd"),
    ({"HOME": "/home/u"}, None, "/home/u/.cache/prefixd"),
    ({"STATE_DIRECTORY": "/var/lib/prefixd"}, "/d", "/d"),
    ({"STATE_DIRECTORY": "/var/lib/prefixd"}, "", None),
])
def test_the_disk_cache_directory_by_default_and_by_flag(env, flag, expected):
    cfg = config_from_args(_args(disk_cache=flag), env=env)
    assert cfg.disk_cache_dir == (None if expected is None else Path(expected))


def test_disk_budget_and_idle_exit_flags():
    cfg = config_from_args(_args(disk_budget="2GiB", idle_exit=30.0), env={"HOME": "/h"})
    assert (cfg.disk_budget_bytes, cfg.idle_exit_s) == (2 << 30, 30.0)
    assert config_from_args(_args(), env={"HOME": "/h"}).disk_budget_bytes == 8 << 30
    with pytest.raises(ConfigError, match="--disk-budget"):
        config_from_args(_args(disk_budget="lots"), env={})
    with pytest.raises(ConfigError, match="--idle-exit"):
        config_from_args(_args(idle_exit=0.0), env={})


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"device": "tpu"}, "--device"),
        ({"dtype": "fp8"}, "--dtype"),
        ({"lanes": 0}, "--lanes"),
        ({"grid": 100, "page_size": 16}, "--grid"),
        ({"metrics_addr": "nope"}, "HOST:PORT"),
        ({"abandon_grace": -1}, "--abandon-grace"),
        ({"abandon_hold_max": -1.0}, "--abandon-hold-max"),
        ({"abandon_hold_max": float("inf")}, "--abandon-hold-max"),
    ],
)
def test_bad_values_name_the_flag(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_args(_args(**flags), env={})


def test_abandon_flags_reach_the_connection_bounds_and_zero_turns_holds_off():
    from prefixd.front.bounds import ConnectionBounds

    cfg = config_from_args(_args(abandon_grace=2, abandon_hold_max=0.0), env={})
    limits = ConnectionBounds.for_config(cfg).abandon
    assert (limits.grace, limits.hold_max_s) == (2, 0.0) and limits.hold_s(50) == 0
    env_cfg = config_from_args(_args(), env={"PREFIXD_ABANDON_GRACE": "9", "PREFIXD_ABANDON_HOLD_MAX": "5"})
    assert ConnectionBounds.for_config(env_cfg).abandon.hold_s(100) == 5.0


def test_bad_number_in_env_is_a_config_error():
    with pytest.raises(ConfigError, match="PREFIXD_"):
        config_from_args(_args(), env={"PREFIXD_LANES": "many"})


def test_every_flag_of_every_command_says_its_default_in_its_help():
    import argparse as ap

    from prefixd.daemon.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, ap._SubParsersAction))  # noqa: SLF001
    missing = []
    for name, sub in commands.choices.items():
        for action in sub._actions:  # noqa: SLF001
            if action.option_strings and not isinstance(action, ap._HelpAction) and "(default" not in (action.help or ""):  # noqa: SLF001
                missing.append(f"{name} {action.option_strings[0]}")
    assert missing == []
def test_mode_defaults_to_auto_and_flags_win_over_env():
    assert config_from_args(_args(), env={}).mode == "auto"
    assert config_from_args(_args(), env={"PREFIXD_MODE": "invariant"}).mode == "invariant"
    assert config_from_args(_args(mode="int4"), env={"PREFIXD_MODE": "invariant"}).mode == "int4"


@pytest.mark.parametrize("flags", [{"mode": "int3"}, {"mode": "int4", "dtype": "fp32"}, {"mode": "int4", "device": "cuda"}])
def test_bad_mode_names_the_flag(flags):
    with pytest.raises(ConfigError, match="--mode"):
        config_from_args(_args(**flags), env={})


def test_draft_mode_and_length_from_flags_and_env():
    assert config_from_args(_args(), env={}).draft == "auto"
    cfg = config_from_args(_args(draft="ngram"), env={"PREFIXD_DRAFT_MAX": "6"})
    assert (cfg.draft, cfg.draft_max) == ("ngram", 6)
    assert config_from_args(_args(draft="mtp"), env={}).draft == "mtp"
    with pytest.raises(ConfigError, match="--draft='eagle'"):
        config_from_args(_args(draft="eagle"), env={})
    with pytest.raises(ConfigError, match="--draft-max -1"):
        config_from_args(_args(draft_max=-1), env={})


def test_cuda_graphs_from_flag_and_env():
    assert config_from_args(_args(), env={}).cuda_graphs == "auto"
    assert config_from_args(_args(), env={"PREFIXD_CUDA_GRAPHS": "off"}).cuda_graphs == "off"
    assert config_from_args(_args(cuda_graphs="off"), env={"PREFIXD_CUDA_GRAPHS": "auto"}).cuda_graphs == "off"
    assert config_from_args(_args(cuda_graphs="eager"), env={}).cuda_graphs == "eager"
    with pytest.raises(ConfigError, match="PREFIXD_CUDA_GRAPHS='always': expected one of auto, eager, off"):
        config_from_args(_args(), env={"PREFIXD_CUDA_GRAPHS": "always"})


def test_overlap_from_flag_and_env():
    assert config_from_args(_args(), env={}).overlap == "auto"
    assert config_from_args(_args(), env={"PREFIXD_OVERLAP": "on"}).overlap == "on"
    assert config_from_args(_args(overlap="off"), env={"PREFIXD_OVERLAP": "on"}).overlap == "off"
    with pytest.raises(ConfigError, match="PREFIXD_OVERLAP='yes': expected one of auto, on, off"):
        config_from_args(_args(), env={"PREFIXD_OVERLAP": "yes"})


def test_draft_auto_picks_per_family_and_mode_and_a_flag_wins():
    assert resolve_draft("auto", "llama", "int4") == "ngram"
    assert resolve_draft("auto", "llama", "invariant") == "ngram"
    assert resolve_draft("auto", "qwen3_5", "invariant") == "off"  # not measured: no drafting
    assert resolve_draft("off", "llama", "int4") == "off"
    assert resolve_draft("ngram", "qwen3_5", "invariant") == "ngram"
    assert resolve_draft("mtp", "qwen3_5", "invariant", draft_head=True) == "mtp"
