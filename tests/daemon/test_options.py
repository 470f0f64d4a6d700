"""The options table (prefixd/daemon/options.py) against everything that restates it: the
`serve` flags and their help, DaemonConfig, SchedulerConfig and the front's limits, and the
flags table of docs/operations.md."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from prefixd.daemon.cli import build_parser
from prefixd.daemon.config import DaemonConfig, config_from_args
from prefixd.daemon.options import DEFAULT_CPU_LANES, OPTIONS, option, size_or_auto
from prefixd.front.abandon import AbandonLimits
from prefixd.front.pacing import PaceLimits
from prefixd.scheduler.config import SchedulerConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _serve_actions() -> dict[str, argparse.Action]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    serve = commands.choices["serve"]
    return {a.option_strings[-1]: a for a in serve._actions  # noqa: SLF001
            if a.option_strings and not isinstance(a, argparse._HelpAction)}  # noqa: SLF001


def _docs_rows(text: str) -> list[tuple[str, str, str]]:
    """(flag, env, default) of each row of the flags table, backticks dropped."""
    section = text.split("### Flags of `prefixd serve`", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `--"):
            flag, env, default = (cell.strip().replace("`", "") for cell in line.split("|")[1:4])
            rows.append((flag, env, default))
    return rows


def test_each_row_is_unique_in_flag_field_and_variable():
    for key in ("flag", "field", "env", "dest"):
        names = [getattr(o, key) for o in OPTIONS]
        assert len(names) == len(set(names)), key
    assert all(o.env.startswith("PREFIXD_") and o.flag.startswith("--") for o in OPTIONS)


def test_serve_has_one_flag_per_row_with_the_generated_help():
    actions = _serve_actions()
    assert list(actions) == [o.flag for o in OPTIONS]
    for opt in OPTIONS:
        assert actions[opt.flag].help.replace("%%", "%") == opt.help_text(), opt.flag
        assert actions[opt.flag].help.endswith(f"(default: {opt.shown_default}; env {opt.env})"), opt.flag
        assert tuple(actions[opt.flag].choices or ()) == opt.choices, opt.flag


def test_draft_max_help_says_the_default_it_gets():
    help_text = _serve_actions()["--draft-max"].help
    assert "(default: 7;" in help_text
    assert config_from_args(argparse.Namespace(), env={}).draft_max == 7 == DaemonConfig().draft_max


def test_a_shown_default_reads_as_the_default():
    for opt in OPTIONS:
        if isinstance(opt.default, (int, float)) and not opt.is_switch:
            assert opt.parse(opt.shown_default) == opt.default, opt.flag
        elif isinstance(opt.default, str) and opt.default:
            assert opt.shown_default == opt.default, opt.flag


def test_the_docs_table_lists_every_flag_variable_and_default_in_order():
    expected = [(o.flag, o.env, o.shown_default) for o in OPTIONS]
    assert _docs_rows(DOCS.read_text()) == expected


def test_daemon_config_fields_and_defaults_are_the_rows():
    fields = {f.name: f.default for f in dataclasses.fields(DaemonConfig)}
    assert fields == {o.field: o.default for o in OPTIONS}


def test_no_flags_and_no_env_give_the_defaults():
    cfg = config_from_args(argparse.Namespace(), env={"HOME": "/home/u"})
    for opt in OPTIONS:
        expected = opt.unset({"HOME": "/home/u"}) if opt.unset is not None else opt.default
        assert getattr(cfg, opt.field) == expected, opt.flag


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: o.flag)
def test_each_variable_reaches_its_field(opt):
    text = {"--model": "m.gguf", "--device": "cuda:1", "--socket": "/s.sock", "--allow-group": "users",
            "--metrics-addr": "127.0.0.1:1", "--cache-budget": "1GiB", "--no-cache": "0", "--disk-cache": "/d",
            "--disk-budget": "1GiB", "--http": "127.0.0.1:8080", "--http-token-file": "/t",
            "--page-size": "32", "--grid": "256", "--prompt-hygiene": "tool_order",
            "--kv-events": "ipc:///run/kv.sock", "--kv-events-replay": "tcp://127.0.0.1:5558"}.get(opt.flag)
    if text is None:
        text = opt.choices[-1] if opt.choices else "3"
    expected = opt.parse(text)
    env = {opt.env: text}
    if opt.flag == "--http":
        env["PREFIXD_METRICS_ADDR"] = ""
    assert getattr(config_from_args(argparse.Namespace(), env=env), opt.field) == expected


def test_scheduler_defaults_that_are_daemon_options_are_the_daemons_on_the_cpu():
    sched = SchedulerConfig()
    assert sched.num_lanes == DEFAULT_CPU_LANES
    for flag, name in (("--grid", "grid"), ("--draft-max", "draft_max"), ("--no-cache", "cache"),
                       ("--cache-budget", "cache_budget_bytes")):
        assert getattr(sched, name) == option(flag).default, name


def test_the_scheduler_config_takes_each_shared_field_from_the_daemon_config():
    cfg = DaemonConfig(lanes=3, grid=64, page_size=16, cache=False, cache_budget_bytes=1 << 20, draft="auto",
                       draft_max=2, max_context=999)
    sched = cfg.scheduler_config(max_context=512, draft="ngram")
    assert sched == SchedulerConfig(num_lanes=3, grid=64, max_context=512, cache=False,
                                    cache_budget_bytes=1 << 20, draft="ngram", draft_max=2)
    shared = {f.name for f in dataclasses.fields(SchedulerConfig)} & {f.name for f in dataclasses.fields(DaemonConfig)}
    assert {n: getattr(sched, n) for n in shared - {"draft", "max_context"}} == {
        n: getattr(cfg, n) for n in shared - {"draft", "max_context"}}


def test_the_fronts_limit_defaults_are_the_daemons():
    pace, abandon = PaceLimits(), AbandonLimits()
    assert (pace.rate, pace.burst, pace.error_cost, pace.connect_cost) == tuple(
        option(f).default for f in ("--client-frame-rate", "--client-frame-burst", "--error-frame-cost",
                                    "--connect-frame-cost"))
    assert (abandon.grace, abandon.hold_max_s) == (option("--abandon-grace").default,
                                                   option("--abandon-hold-max").default)


def test_size_or_auto_reads_units():
    assert size_or_auto("auto") is None
    assert [size_or_auto(t) for t in ("1000", "512M", "4GiB", "1.5Ki")] == [1000, 512_000_000, 4 << 30, 1536]
    with pytest.raises(ValueError, match="expected BYTES"):
        size_or_auto("lots")


def test_kv_events_endpoints_are_checked_at_start_up():
    from prefixd.daemon.config import ConfigError

    cfg = config_from_args(argparse.Namespace(), env={"PREFIXD_KV_EVENTS": "tcp://127.0.0.1:5557?topic=kv@a@m"})
    assert cfg.kv_events == "tcp://127.0.0.1:5557?topic=kv@a@m" and cfg.kv_events_replay == ""
    with pytest.raises(ConfigError, match=r"--kv-events udp://x:1: expected tcp://HOST:PORT or ipc://PATH"):
        config_from_args(argparse.Namespace(), env={"PREFIXD_KV_EVENTS": "udp://x:1"})
    with pytest.raises(ConfigError, match=r"--kv-events-replay ipc:///r\?x=1: the only parameters are topic=NAME "
                                          r"and layout=array\|map"):
        config_from_args(argparse.Namespace(), env={"PREFIXD_KV_EVENTS_REPLAY": "ipc:///r?x=1"})
    cfg = config_from_args(argparse.Namespace(), env={"PREFIXD_KV_EVENTS": "ipc:///p?layout=map"})
    assert cfg.kv_events == "ipc:///p?layout=map"
    with pytest.raises(ConfigError, match=r"--kv-events ipc:///p\?layout=json: layout=json: expected one of array, map"):
        config_from_args(argparse.Namespace(), env={"PREFIXD_KV_EVENTS": "ipc:///p?layout=json"})


def test_kv_events_without_pyzmq_is_a_clear_start_up_error(monkeypatch):
    import importlib.util

    from prefixd.daemon.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zmq" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--kv-events ipc:///k: needs pyzmq: pip install 'prefixd\[kv-events\]'"):
        config_from_args(argparse.Namespace(), env={"PREFIXD_KV_EVENTS": "ipc:///k"})
