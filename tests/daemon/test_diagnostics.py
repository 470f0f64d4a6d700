"""Cache diagnostics through the socket: where a prompt left the cache, why nothing matched,
the misses counted by reason, `prefixd why`, and served bits unchanged by any of it."""

from __future__ import annotations

import argparse
import json

import anyio

from prefixd.daemon import client_cli
from prefixd.front.diagnostics import cache_report
from prefixd.ipc.client import AsyncClient
from prefixd.scheduler.config import SchedulerConfig
from prefixd.scheduler.engine import Engine
from prefixd.engine.runtime import Runtime
from tests.daemon.fakes import VOCAB, ByteTokenizer, LetterDevice
from tests.daemon.harness import running_server, wait_idle

TOK = ByteTokenizer()
A = "the quick brown fox jumps over the lazy dog"  # 43 byte tokens; P = 4, G = 8
B = A[:21] + "X" + A[22:]  # differs at row 21 (the "u" of "jumps")


def misses(server, reason: str) -> float:
    return server.metrics.registry.get_sample_value("prefixd_prefix_cache_misses_total", {"reason": reason}) or 0


async def test_a_prompt_differing_at_a_known_token_reports_the_row_both_tokens_and_the_text_around(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            await client.generate(prompt=A, max_tokens=2).collect()
            result = await client.generate(prompt=B, max_tokens=2).collect()
        usage = result.usage
        assert (usage.cache, usage.cached_tokens, usage.cache_reason) == ("hit", 20, "diverged")
        div = usage.divergence
        assert (div.at, div.new_id, div.cached_id) == (21, TOK.encode("X")[0], TOK.encode("u")[0])
        assert div.before_ids == tuple(TOK.encode(A[13:21]))
        assert div.new_ids == tuple(TOK.encode(B[21:29])) and div.cached_ids == tuple(TOK.encode(A[21:29]))
        assert div.excerpt == {"before": "wn fox j", "new_token": "X", "new_rest": "mps ove",
                               "cached_token": "u", "cached_rest": "mps ove"}
        await wait_idle(server)


async def test_an_identical_request_is_a_hit_with_nothing_to_explain(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            await client.generate(prompt=A, max_tokens=2).collect()
            usage = (await client.generate(prompt=A, max_tokens=2).collect()).usage
        assert (usage.cache, usage.cached_tokens, usage.cache_reason, usage.divergence) == ("hit", 43, None, None)
        await wait_idle(server)


async def test_an_empty_namespace_a_too_short_prompt_and_cache_off_are_named_and_counted(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            first = (await client.generate(prompt=A, max_tokens=2, namespace="n").collect()).usage
            short = (await client.generate(prompt="thx", max_tokens=2, namespace="n").collect()).usage
            off = (await client.generate(prompt=A, max_tokens=2, namespace="n", cache=False).collect()).usage
        assert (first.cache, first.cache_reason, first.divergence) == ("miss", "namespace_empty", None)
        assert (short.cache, short.cache_reason) == ("miss", "too_short")
        assert (short.divergence.at, short.divergence.new_id, short.divergence.cached_id) == (
            2, TOK.encode("x")[0], TOK.encode("e")[0])
        assert (off.cache, off.cache_reason) == ("off", "cache_off")
        await wait_idle(server)
        assert [misses(server, r) for r in ("namespace_empty", "too_short", "cache_off", "evicted")] == [1, 1, 1, 0]


def small_store_factory(device: LetterDevice, cache_budget_bytes: int):
    """The harness's runtime over one lane and a prefix store of a few pages."""

    def factory(cfg, observer) -> Runtime:
        config = SchedulerConfig(num_lanes=1, grid=8, round_row_budget=64, cache_budget_bytes=cache_budget_bytes)
        engine = Engine(device, config, observer=observer)
        info = {"name": "letters", "family": "fake", "vocab_size": VOCAB, "max_context": engine.max_context,
                "hidden_size": 4, "lanes": 1}
        factory.runtime = Runtime(engine=engine, tokenizer=ByteTokenizer(), model_info=info)
        return factory.runtime

    return factory


async def test_a_prefix_evicted_since_an_earlier_prompt_kept_it_is_reported_evicted(tmp_path):
    device = LetterDevice(num_lanes=1)
    reserved = 10_000 + 8 * 8  # weights and one lane's prefill workspace come off the budget first
    factory = small_store_factory(device, reserved + 14 * 1024)  # 14 pages: one 43-token prompt, not two
    async with running_server(tmp_path, device, runtime_factory=factory) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            await client.generate(prompt=A, max_tokens=1).collect()
            await client.generate(prompt=A.upper(), max_tokens=1, namespace="other").collect()
            usage = (await client.generate(prompt=B, max_tokens=1).collect()).usage
        assert (usage.cache, usage.cached_tokens, usage.cache_reason) == ("miss", 0, "evicted")
        await wait_idle(server)
        assert misses(server, "evicted") == 1


async def test_prefixd_why_prints_the_last_requests_reports(tmp_path, capsys):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            await client.generate(prompt=A, max_tokens=2).collect()
            await client.generate(prompt=B, max_tokens=2).collect()
        await wait_idle(server)
        args = argparse.Namespace(socket=str(server.socket_path), last=2, json=False)
        assert await anyio.to_thread.run_sync(client_cli._why, args) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "request 1: miss, 0 of 43 prompt tokens cached; namespace_empty: nothing is cached in its namespace"
        assert out[1].startswith("request 2: hit, 20 of 43 prompt tokens cached; diverged: ")
        assert out[2:] == [f"  diverged at token 21: prompt token {TOK.encode('X')[0]}, cached token {TOK.encode('u')[0]}",
                           "  prompt  ...wn fox j[X]mps ove",
                           "  cached  ...wn fox j[u]mps ove"]
        args = argparse.Namespace(socket=str(server.socket_path), last=1, json=True)
        assert await anyio.to_thread.run_sync(client_cli._why, args) == 0
        [report] = json.loads(capsys.readouterr().out)
        assert (report["cache"], report["cached_tokens"], report["divergence"]["at"]) == ("hit", 20, 21)
        assert report["divergence"]["excerpt"]["cached_token"] == "u"


async def test_diagnostics_leave_the_served_ids_and_logits_bits_as_a_cold_run(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            await client.generate(prompt=A, max_tokens=2).collect()
            resumed = await client.generate(prompt=B, max_tokens=6, logits=True).collect()
            cold = await client.generate(prompt=B, max_tokens=6, logits=True, cache=False).collect()
        assert resumed.usage.cached_tokens == 20 and resumed.usage.divergence is not None
        assert (resumed.ids, resumed.logits_sha256) == (cold.ids, cold.logits_sha256)
        await wait_idle(server)


def test_the_http_fronts_report_is_the_usage_with_its_excerpt():
    from prefixd.ipc.events import Divergence, Usage

    usage = Usage(prompt_tokens=9, cached_tokens=4, cache="hit", cache_reason="diverged",
                  divergence=Divergence(at=5, new_id=TOK.encode("b")[0], cached_id=TOK.encode("c")[0],
                                        before_ids=tuple(TOK.encode("xyz")), new_ids=tuple(TOK.encode("bd")),
                                        cached_ids=tuple(TOK.encode("ce"))))
    assert cache_report(usage, TOK) == {
        "result": "hit", "cached_tokens": 4, "prompt_tokens": 9, "reason": "diverged",
        "divergence": {"at": 5, "new_id": TOK.encode("b")[0], "cached_id": TOK.encode("c")[0],
                       "before_ids": TOK.encode("xyz"), "new_ids": TOK.encode("bd"), "cached_ids": TOK.encode("ce"),
                       "excerpt": {"before": "xyz", "new_token": "b", "new_rest": "d", "cached_token": "c",
                                   "cached_rest": "e"}}}
    assert cache_report(Usage(prompt_tokens=3, cached_tokens=3, cache="hit"), TOK) == {
        "result": "hit", "cached_tokens": 3, "prompt_tokens": 3}


async def test_an_engine_in_a_process_of_its_own_sends_the_divergence_and_the_miss_reason(tmp_path):
    from tests.daemon.test_engine_process import letters_config, letters_engine, process_server

    cfg = letters_config(tmp_path)
    async with process_server(tmp_path, letters_engine(cfg), cfg) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            first = (await client.generate(prompt=A, max_tokens=2).collect()).usage
            usage = (await client.generate(prompt=B, max_tokens=2).collect()).usage
            reports = (await client.status())["cache_reports"]
        assert first.cache_reason == "namespace_empty"
        assert (usage.divergence.at, usage.divergence.excerpt["new_token"], usage.divergence.excerpt["cached_token"]) == (
            21, "X", "u")
        assert [r["cache_reason"] for r in reports] == ["namespace_empty", "diverged"]
        assert misses(server, "namespace_empty") == 1


def test_why_says_where_the_cached_rows_end_and_shows_ids_without_an_excerpt():
    report = {"stream_id": 4, "namespace": "agent", "cache": "hit", "prompt_tokens": 50, "cached_tokens": 40,
              "cache_reason": "diverged",
              "divergence": {"at": 43, "new_id": 70, "before_ids": [66, 67], "new_ids": [70, 71], "cached_ids": []}}
    assert client_cli.why_lines(report) == [
        "request 4 namespace 'agent': hit, 40 of 50 prompt tokens cached; diverged: "
        "the prompt differs from the cache below any further resume point",
        "  diverged at token 43: the cached rows end there (prompt token 70)",
        "  prompt ids [66, 67] | [70, 71]",
        "  cached ids [66, 67] | []"]
    report["divergence"]["excerpt"] = {"before": "a\nb", "new_token": "c", "new_rest": "d",
                                       "cached_token": "", "cached_rest": ""}
    assert client_cli.why_lines(report)[2:] == ["  prompt  ...a\\nb[c]d", "  cached  ...a\\nb[]"]
