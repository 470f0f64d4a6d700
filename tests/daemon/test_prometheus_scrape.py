"""A real Prometheus server scrapes the daemon's exporter; PromQL sees exactly what usage reported."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import anyio
import pytest

from prefixd.ipc.client import AsyncClient
from prefixd.ipc.events import Usage
from tests.daemon.fakes import LetterDevice
from tests.daemon.harness import running_server, wait_idle

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary on PATH (apt install prometheus)")

SCRAPE_WAIT_S = 30.0  # an upper bound on waiting for the first scrape, not a timing assertion


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Prometheus:
    """One prometheus server process on loopback, with its log file for failure messages."""

    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def query(self, promql: str) -> list[dict] | None:
        """The instant-vector result of `promql`, or None while the server isn't answering yet."""
        return self.api("query?" + urllib.parse.urlencode({"query": promql}))

    def api(self, path: str) -> Any:
        """The `data` of GET /api/v1/<path>, or None while the server isn't answering yet."""
        url = f"{self.base_url}/api/v1/{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError):
            return None
        assert body["status"] == "success", body
        data = body["data"]
        return data["result"] if path.startswith("query?") else data


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[..., Prometheus]]:
    """Start a prometheus scraping 127.0.0.1:<port> every second, evaluating `rule_files`;
    always stopped afterwards."""
    started: list[Prometheus] = []

    def start(target_port: int, rule_files: tuple[Path, ...] = ()) -> Prometheus:
        root = tmp_path / "prometheus"
        root.mkdir()
        config = root / "prometheus.yml"
        rules = "".join(f"  - {path}\n" for path in rule_files)
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + "scrape_configs:\n  - job_name: prefixd\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
        )
        port = _free_loopback_port()
        log_path = root / "prometheus.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=root,
            )
        prom = Prometheus(proc, f"http://127.0.0.1:{port}", log_path)
        started.append(prom)
        return prom

    yield start
    for prom in started:
        prom.proc.terminate()
        try:
            prom.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prom.proc.kill()
            prom.proc.wait()


async def _scraped(prom: Prometheus, queries: list[str]) -> dict[str, list[dict]]:
    """Poll until every query has a sample (prometheus up, our target scraped); bounded wait."""
    deadline = time.monotonic() + SCRAPE_WAIT_S
    while True:
        if prom.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {prom.proc.returncode}:\n{prom.log()}")
        results = {q: await anyio.to_thread.run_sync(prom.query, q) for q in queries}
        if all(results.values()):
            return results  # type: ignore[return-value]
        if time.monotonic() > deadline:
            pytest.fail(f"prometheus had no samples for {[q for q, r in results.items() if not r]} "
                        f"within {SCRAPE_WAIT_S}s:\n{prom.log()}")
        await anyio.sleep(0.2)


def _value(result: list[dict]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


async def test_a_real_prometheus_scrape_matches_the_usage_of_the_requests(tmp_path, start_prometheus):
    # One lane, so the second conversation evicts the first and its extension is a store hit.
    async with running_server(tmp_path, LetterDevice(num_lanes=1)) as server:
        first = "the quick brown fox jumps over the lazy dog"
        usages: list[Usage] = []
        async with await AsyncClient.connect(server.socket_path) as client:
            for prompt in (first, "a different conversation entirely", first + " again"):
                result = await client.generate(prompt=prompt, max_tokens=3).collect()
                usages.append(result.usage)
            # continues the resident lane: the prompt extends the last prompt and its reply
            result = await client.generate(prompt=first + " again" + result.text + " more", max_tokens=3).collect()
            usages.append(result.usage)
        assert [u.cache for u in usages] == ["miss", "miss", "hit", "resident"]
        status = await wait_idle(server)
        store = status["store"]

        prom = start_prometheus(server.metrics_port)
        lookups = {r: 'prefixd_prefix_cache_lookups_total{job="prefixd",result="%s"}' % r
                   for r in ("hit", "miss", "resident")}
        queries = [
            'up{job="prefixd"}', *lookups.values(),
            "prefixd_prefix_cache_queries_tokens_total", "prefixd_prefix_cache_hits_tokens_total",
            'prefixd_requests_total{finish_reason="length"}', "sum(prefixd_requests_total)",
            "prefixd_prompt_tokens_total", "prefixd_generation_tokens_total",
            "prefixd_prefix_cache_bytes", "prefixd_prefix_cache_budget_bytes",
            "prefixd_lanes_busy", "prefixd_requests_waiting",
            "prefixd_prefix_cache_hits_tokens_total / prefixd_prefix_cache_queries_tokens_total",
        ]
        got = {q: _value(r) for q, r in (await _scraped(prom, queries)).items()}

    hits_tokens = sum(u.cached_tokens for u in usages)
    queries_tokens = sum(u.prompt_tokens for u in usages)
    resident = [u for u in usages if u.cache == "resident"]
    assert got['up{job="prefixd"}'] == 1
    for result, query in lookups.items():
        assert got[query] == sum(1 for u in usages if u.cache == result), result
    assert got["prefixd_prefix_cache_queries_tokens_total"] == queries_tokens
    assert got["prefixd_prefix_cache_hits_tokens_total"] == hits_tokens
    assert got["prefixd_prefix_cache_hits_tokens_total / prefixd_prefix_cache_queries_tokens_total"] == (
        hits_tokens / queries_tokens)
    assert 0 < hits_tokens < queries_tokens
    # the store's own counters are the non-resident part of the same totals
    assert got[lookups["hit"]] == store["hits"] and got[lookups["miss"]] == store["misses"]
    resident_queries = sum(u.prompt_tokens for u in resident)
    resident_hits = sum(u.cached_tokens for u in resident)
    assert got["prefixd_prefix_cache_queries_tokens_total"] == store["query_tokens"] + resident_queries
    assert got["prefixd_prefix_cache_hits_tokens_total"] == store["hit_tokens"] + resident_hits
    assert got["prefixd_prefix_cache_bytes"] == store["bytes"]
    assert got["prefixd_prefix_cache_budget_bytes"] == store["budget_bytes"]
    assert got['prefixd_requests_total{finish_reason="length"}'] == len(usages)
    assert got["sum(prefixd_requests_total)"] == len(usages)
    assert got["prefixd_prompt_tokens_total"] == queries_tokens
    assert got["prefixd_generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert got["prefixd_lanes_busy"] == status["lanes_busy"] == 0
    assert got["prefixd_requests_waiting"] == status["waiting"] == 0


DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DISK_METRICS = ("prefixd_disk_cache_bytes", "prefixd_disk_cache_hits_tokens_total",
                "prefixd_disk_cache_written_bytes_total", "prefixd_disk_cache_corrupt_total")
SHARED_METRICS = ("prefixd_shared_cache_state", "prefixd_shared_cache_hits_tokens_total",
                  "prefixd_shared_cache_fetched_total", "prefixd_shared_cache_published_total",
                  "prefixd_shared_cache_dropped_total", "prefixd_shared_cache_errors_total",
                  "prefixd_shared_cache_skipped_total")


def dashboard_queries() -> dict[str, str]:
    """Every target expression of the shipped Grafana dashboard, keyed by 'panel/refId', with
    Grafana's variables given the values a dashboard on this Prometheus would use."""
    dashboard = json.loads((DEPLOY / "grafana" / "prefixd.json").read_text())
    out = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "5m").replace("$job", "prefixd")
            assert "$" not in expr, expr
            out[f"{panel['title']}/{target['refId']}"] = expr
    return out


def test_the_dashboard_has_the_panels_the_operators_need():
    queries = dashboard_queries()
    titles = {key.rpartition("/")[0] for key in queries}
    for needle in ("Hit ratio", "cached vs cold", "Evictions by reason", "Lanes busy", "Tokens per second",
                   "Disk cache bytes"):
        assert any(needle in title for title in titles), needle
    text = "\n".join(queries.values())
    for name in DISK_METRICS + SHARED_METRICS:
        assert name in text, name


async def test_every_dashboard_query_returns_data_and_the_alert_rules_load(tmp_path, start_prometheus):
    queries = dashboard_queries()
    async with running_server(tmp_path, LetterDevice(num_lanes=1)) as server:
        prom = start_prometheus(server.metrics_port, (DEPLOY / "prometheus" / "prefixd-alerts.yml",))
        await _scraped(prom, ['up{job="prefixd"}'])  # a scrape before the traffic, so rates see it grow
        first = "the quick brown fox jumps over the lazy dog"
        async with await AsyncClient.connect(server.socket_path) as client:
            for prompt in (first, "a different conversation entirely", first + " again"):
                await client.generate(prompt=prompt, max_tokens=3).collect()
        await wait_idle(server)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        exposition = await anyio.to_thread.run_sync(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
        # Disk-tier panels may be empty only where this build has no disk tier to export them.
        disk_tier = "prefixd_disk_cache_bytes" in exposition
        required = {k: q for k, q in queries.items() if disk_tier or not any(n in q for n in DISK_METRICS)}
        got = await _scraped(prom, list(required.values()))
        hit_ratio = next(q for k, q in queries.items() if k.startswith("Hit ratio"))
        while float(got[hit_ratio][0]["value"][1]) == 0:  # the scrape before the hit may come first
            await anyio.sleep(0.2)
            got[hit_ratio] = await anyio.to_thread.run_sync(prom.query, hit_ratio)
        rules = await _rules_evaluated(prom)
    assert 0 < float(got[hit_ratio][0]["value"][1]) < 1
    if not disk_tier:
        for key, query in queries.items():
            if key not in required:
                assert await anyio.to_thread.run_sync(prom.query, query) in ([], None), key
    assert sorted(rule["name"] for rule in rules) == [
        "PrefixdCacheHitRatioCollapsed", "PrefixdDiskCacheCorruptFiles", "PrefixdQueueGrowing",
        "PrefixdSharedCacheDown"]
    assert {rule["state"] for rule in rules} == {"inactive"}


async def _rules_evaluated(prom: Prometheus) -> list[dict]:
    """The alert rules once prometheus has evaluated each of them (health ok); bounded wait."""
    deadline = time.monotonic() + SCRAPE_WAIT_S
    while True:
        data = await anyio.to_thread.run_sync(prom.api, "rules")
        rules = [r for group in (data or {}).get("groups", []) for r in group["rules"]]
        if rules and all(r["health"] == "ok" for r in rules):
            return rules
        if time.monotonic() > deadline:
            pytest.fail(f"prometheus did not evaluate the alert rules: {rules}\n{prom.log()}")
        await anyio.sleep(0.2)
