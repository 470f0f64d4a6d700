"""`prefixd status` in words: the lines it prints from the daemon's status map."""

from __future__ import annotations

import argparse
import contextlib

import pytest

from prefixd.daemon import client_cli


def _print_status(monkeypatch, capsys, info: dict) -> str:
    class Client:
        def status(self) -> dict:
            return info

    monkeypatch.setattr(client_cli, "_connect", lambda args: contextlib.nullcontext(Client()))
    assert client_cli._status(argparse.Namespace(json=False, socket="/run/x.sock")) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("graphs, line", [
    (None, None),
    ({"captured": 48, "startup_s": 9.25}, "graphs    48 decode programs captured in 9.2s"),
    ({"captured": 0, "failed": "RuntimeError: capture"}, "graphs    not captured (RuntimeError: capture): rounds run op by op"),
])
def test_status_names_the_cuda_graphs_only_where_they_were_tried(monkeypatch, capsys, graphs, line):
    out = _print_status(monkeypatch, capsys, {"model": {"name": "m.gguf", "cuda_graphs": graphs}, "store": None})
    assert out.splitlines()[1].startswith("model     m.gguf")
    graph_lines = [l for l in out.splitlines() if l.startswith("graphs")]
    assert graph_lines == ([] if line is None else [line])


@pytest.mark.parametrize("overlap", [None, False, True])
def test_status_says_when_rounds_overlap_the_next_rounds_admission(monkeypatch, capsys, overlap):
    out = _print_status(monkeypatch, capsys, {"model": {"name": "m.gguf", "overlap": overlap}, "store": None})
    lines = [l for l in out.splitlines() if l.startswith("overlap")]
    assert lines == (["overlap   on: requests are seated for the next round while a round runs"] if overlap else [])
