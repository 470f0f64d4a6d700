"""DaemonConfig from flags and environment."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prefixd.daemon.config import ConfigError, DaemonConfig, config_from_args, parse_size


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**kw)


def test_defaults_without_flags_or_env():
    cfg = config_from_args(_args(), env={"HOME": "/home/u"})
    assert cfg == DaemonConfig(disk_cache_dir=Path("/home/u/.cache/prefixd"))
    assert cfg.num_lanes == 8
    assert cfg.metrics_addr == "127.0.0.1:9464"
    assert cfg.resolved_max_context(8192) == 4096


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


def test_parse_size_units():
    assert parse_size("auto") is None
    assert parse_size("1000") == 1000
    assert parse_size("512M") == 512_000_000
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5Ki") == 1536
    with pytest.raises(ConfigError, match="cache budget"):
        parse_size("lots")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"device": "tpu"}, "--device"),
        ({"dtype": "fp8"}, "--dtype"),
        ({"lanes": 0}, "--lanes"),
        ({"grid": 100, "page_size": 16}, "--grid"),
        ({"metrics_addr": "nope"}, "HOST:PORT"),
    ],
)
def test_bad_values_name_the_flag(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_args(_args(**flags), env={})


def test_bad_number_in_env_is_a_config_error():
    with pytest.raises(ConfigError, match="PREFIXD_"):
        config_from_args(_args(), env={"PREFIXD_LANES": "many"})


def test_mode_defaults_to_auto_and_flags_win_over_env():
    assert config_from_args(_args(), env={}).mode == "auto"
    assert config_from_args(_args(), env={"PREFIXD_MODE": "invariant"}).mode == "invariant"
    assert config_from_args(_args(mode="int4"), env={"PREFIXD_MODE": "invariant"}).mode == "int4"


@pytest.mark.parametrize("flags", [{"mode": "int3"}, {"mode": "int4", "dtype": "fp32"}, {"mode": "int4", "device": "cuda"}])
def test_bad_mode_names_the_flag(flags):
    with pytest.raises(ConfigError, match="--mode"):
        config_from_args(_args(**flags), env={})
