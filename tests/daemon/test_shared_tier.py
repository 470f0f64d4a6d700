"""Daemons sharing snapshots through a real Redis/Valkey server (skips without one, or without
the redis package): a daemon with an empty disk serves another's next turn from the shared
tier with a cold run's bits; a corrupt entry is never served; a store that dies mid-run costs
hits, never a request: the
usage says `shared` where the rows came from there, and the metrics say the store is down."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest

from prefixd.front.engine_link import ProcessLauncher
from prefixd.ipc.client import AsyncClient
from tests.daemon.test_engine_process import letters_config, metric, process_server
from tests.helpers.redis_server import redis_server  # noqa: F401 (a fixture)
from tests.helpers.tiny_models import make_tiny_hf_dir

PROMPT = list(range(10, 10 + 70))  # turn 1
NEXT = PROMPT + list(range(300, 330))  # turn 2: turn 1's rows, then 30 new ones
STARTS = {tuple(NEXT): [len(PROMPT)]}  # turn 2's chunk starts: turn 1's end is a cut of its schedule


@pytest.fixture(scope="module", params=["llama", "hybrid"])
def tiny_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A row-invariant family, and the hybrid recurrent one (its snapshots carry lane state and
    resume only at cuts of the request's own schedule)."""
    path = tmp_path_factory.mktemp(f"tiny_shared_{request.param}") / "model"
    if request.param == "llama":
        return make_tiny_hf_dir(path, "llama", seed=5)
    from tests.daemon.test_runtime import _tiny_hybrid

    return _tiny_hybrid(path, mtp_layers=0)


def daemon_config(tmp_path: Path, name: str, tiny_dir: Path, url: str):
    return letters_config(tmp_path / name, model=str(tiny_dir), dtype="fp32", lanes=2, max_context=256,
                          cache_budget_bytes=64 << 20, disk_cache_dir=tmp_path / name / "disk",
                          shared_cache_url=url)


async def disk_status(server) -> dict:
    return (await server.link.status())["disk"]


STATES = [f'prefixd_shared_cache_state{{state="{s}"}}' for s in ("up", "busy", "down")]


async def metrics_reach(server, want: dict[str, float]) -> None:
    """Wait until the exporter reads `want` (the engine reports the tier's stats with its next
    round or status reply, after the status that saw them)."""
    with anyio.fail_after(30):
        while {n: await anyio.to_thread.run_sync(metric, server, n) for n in want} != want:
            await disk_status(server)  # a status polls the tier, which reports what changed
            await anyio.sleep(0.05)


async def generate(server, tokens, **kw):
    async with await AsyncClient.connect(server.socket_path) as client:
        return await client.generate(tokens=tokens, max_tokens=5, logits=True,
                                     chunk_starts=STARTS.get(tuple(tokens), []), **kw).collect()


async def test_daemons_share_snapshots_exactly_and_survive_a_bad_or_dead_store(tmp_path, tiny_dir, redis_server):
    url = redis_server.url
    cfg_a, cfg_b, cfg_c = (daemon_config(tmp_path, n, tiny_dir, url) for n in "abc")
    async with process_server(tmp_path / "a", ProcessLauncher(cfg_a), cfg_a) as a, \
            process_server(tmp_path / "b", ProcessLauncher(cfg_b), cfg_b) as b:
        cold_next = await generate(a, NEXT, cache=False)  # reuses and keeps nothing
        await generate(a, PROMPT)
        with anyio.fail_after(60):  # written to A's disk, then sent
            while (s := await disk_status(a))["shared_published"] < s["entries"] or not s["entries"]:
                await anyio.sleep(0.05)
        assert len(redis_server.keys()) == s["entries"]
        await metrics_reach(a, {**dict(zip(STATES, (1, 0, 0))), "prefixd_shared_cache_published_total": s["entries"]})

        # B has an empty disk and RAM: turn 2 resumes from A's entries, with a cold run's bits
        resumed = await generate(b, NEXT)
        assert (resumed.ids, resumed.logits_sha256) == (cold_next.ids, cold_next.logits_sha256)
        assert (resumed.usage.cached_tokens, resumed.usage.cache) == (len(PROMPT), "shared")
        s = await disk_status(b)
        assert (s["shared"], s["shared_hit_tokens"], s["hit_tokens"]) == ("up", len(PROMPT), 0)
        await metrics_reach(b, {**dict(zip(STATES, (1, 0, 0))), "prefixd_shared_cache_hits_tokens_total": len(PROMPT),
                                "prefixd_shared_cache_fetched_total": 1,
                                'prefixd_time_to_first_token_seconds_count{cache="shared"}': 1})

        # every value spoilt in its body: C (empty disk) never serves one, and prefills cold
        for key in redis_server.keys():
            value = bytearray(redis_server.client.get(key))
            value[-40] ^= 1
            redis_server.client.set(key, bytes(value))
        async with process_server(tmp_path / "c", ProcessLauncher(cfg_c), cfg_c) as c:
            fresh = await generate(c, NEXT)
            assert (fresh.ids, fresh.logits_sha256) == (cold_next.ids, cold_next.logits_sha256)
            assert fresh.usage.cached_tokens == 0
            assert fresh.usage.cache == "miss"
            s = await disk_status(c)
            assert s["shared_dropped"] >= 1 and s["shared_hit_tokens"] == 0
            await metrics_reach(c, {"prefixd_shared_cache_dropped_total": s["shared_dropped"]})

            # the store dies: every daemon keeps serving, from its own RAM and disk or cold
            redis_server.stop()
            other = list(range(400, 440))
            cold_other = await generate(a, other, cache=False)
            for server in (a, b, c):
                got = await generate(server, other)
                assert (got.ids, got.logits_sha256) == (cold_other.ids, cold_other.logits_sha256)
                again = await generate(server, NEXT)
                assert (again.ids, again.logits_sha256) == (cold_next.ids, cold_next.logits_sha256)
                assert again.usage.cached_tokens > 0  # its own RAM still holds turn 2 (or turn 1)
            for server in (a, b, c):
                assert (await disk_status(server))["shared"].startswith("down: ")
                s = await disk_status(server)
                await metrics_reach(server, {**dict(zip(STATES, (0, 0, 1))),
                                             "prefixd_shared_cache_errors_total": s["shared_errors"]})
                assert s["shared_errors"] >= 1


def test_an_unusable_url_leaves_the_shared_tier_off_with_a_warning(caplog):
    from prefixd.disk.index import TierIdentity
    from prefixd.engine.runtime import build_shared_tier

    identity = TierIdentity("m", "fp32", "cpu", "invariant", 16, 1024, 0, 2048, 0, True)
    with caplog.at_level(logging.WARNING, logger="prefixd.runtime"):
        assert build_shared_tier("", identity) is None and not caplog.records
        assert build_shared_tier("http://cachehost:6379", identity) is None
    assert [r.message for r in caplog.records] == [
        "shared cache off: --shared-cache 'http://cachehost:6379': expected redis://HOST:PORT/DB or unix:///PATH; "
        "caching locally"]
