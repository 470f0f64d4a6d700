"""What a router probes on a worker (front/http/worker.py): SMG's /v1/loads, vllm-router's
/get_load, the facts routes, and /metrics with vLLM's names (metrics/compat.py), each
answered from the daemon's real state, over the letters device."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon.fakes import ByteTokenizer, LetterDevice
from tests.daemon.harness import running_server, wait_idle

TOK = ByteTokenizer()
HI = [{"role": "user", "content": "hi"}]


def url(server, path: str) -> str:
    return f"http://127.0.0.1:{server.http.port}{path}"


async def rank(client: httpx.AsyncClient, server) -> dict:
    body = (await client.get(url(server, "/v1/loads"))).json()
    assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1
    return body["loads"][0]


def samples(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def open_stream(client: httpx.AsyncClient, server, content: str, tg) -> anyio.Event:
    """Start a long streamed chat in `tg`; the event is set once its first token arrived.
    The stream runs until the task group is cancelled."""
    first = anyio.Event()

    async def run() -> None:
        body = {"model": "letters", "messages": [{"role": "user", "content": content}], "max_tokens": 1500,
                "stream": True}
        async with client.stream("POST", url(server, "/v1/chat/completions"), json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    first.set()

    tg.start_soon(run)
    return first


async def test_loads_count_a_running_and_a_waiting_stream_then_none(tmp_path):
    # one lane: the second stream waits for its seat while the first runs
    device = LetterDevice(num_lanes=1, num_pages=1024, max_context=2048, round_delay_s=0.002)
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient(timeout=None) as client:
            idle = await rank(client, server)
            assert (idle["num_running_reqs"], idle["num_waiting_reqs"], idle["num_used_tokens"]) == (0, 0, 0)
            assert (idle["max_total_num_tokens"], idle["max_running_requests"], idle["token_usage"]) == (4096, 1, 0.0)
            async with anyio.create_task_group() as tg:
                await (await open_stream(client, server, "first", tg)).wait()
                running = await rank(client, server)
                assert (running["num_running_reqs"], running["num_waiting_reqs"]) == (1, 0)
                assert running["num_used_tokens"] > 0 and running["num_used_tokens"] % 4 == 0
                assert running["token_usage"] == running["num_used_tokens"] / 4096
                await open_stream(client, server, "second", tg)
                while (both := await rank(client, server))["num_waiting_reqs"] == 0:
                    await anyio.sleep(0.01)
                assert (both["num_running_reqs"], both["num_waiting_reqs"], both["num_total_reqs"]) == (1, 1, 2)
                assert (await client.get(url(server, "/get_load"))).json() == {"load": 2}
                tg.cancel_scope.cancel()
            status = await wait_idle(server)
            after = await rank(client, server)
        # the prefix cache still holds the prompts' pages; no running stream does
        assert status["pages_used"] > 0
        assert (after["num_running_reqs"], after["num_waiting_reqs"], after["num_used_tokens"]) == (0, 0, 0)


async def test_facts_name_the_model_lanes_context_and_pool_and_not_another_engine(tmp_path):
    device = LetterDevice(num_lanes=3, num_pages=200, page_size=8, max_context=512)
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient() as client:
            info = (await client.get(url(server, "/get_server_info"))).json()
            model = (await client.get(url(server, "/model_info"))).json()
            old_model = (await client.get(url(server, "/get_model_info"))).json()
            # SMG takes a worker answering /server_info for SGLang and /version for vLLM
            fingerprints = [(await client.get(url(server, p))).status_code for p in ("/server_info", "/version")]
    assert (info["model"], info["served_model_name"], info["context_length"]) == ("letters", "letters", 512)
    assert (info["max_running_requests"], info["max_total_tokens"], info["page_size"]) == (3, 1600, 8)
    assert (info["tp_size"], info["dp_size"], info["is_embedding"]) == (1, 1, False)
    assert info["version"].startswith("prefixd ")
    assert model == old_model and model["is_generation"] is True
    assert fingerprints == [404, 404]


async def test_metrics_on_the_http_port_give_vllm_names_for_prefixd_counters(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient() as client:
            for _ in range(2):  # the second turn is a hit
                body = {"model": "letters", "messages": HI, "max_tokens": 3}
                assert (await client.post(url(server, "/v1/chat/completions"), json=body)).status_code == 200
            await wait_idle(server)
            scraped = samples((await client.get(url(server, "/metrics"))).text)
            own = samples((await client.get(f"http://127.0.0.1:{server.metrics_port}/metrics")).text)
    value = lambda fams, name: [s.value for s in fams[name]]  # noqa: E731
    queries = value(own, "prefixd_prefix_cache_queries_tokens")
    hits = value(own, "prefixd_prefix_cache_hits_tokens")
    assert hits[0] > 0
    assert value(scraped, "vllm:prefix_cache_queries") == queries
    assert value(scraped, "vllm:prefix_cache_hits") == hits
    assert scraped["vllm:prefix_cache_hits"][0].labels == {"model_name": "letters"}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        assert value(scraped, name) == [0.0], name
    info = scraped["vllm:cache_config_info"][0]
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"], info.value) == ("4", "256", 1.0)
    assert value(scraped, "prefixd_prefix_cache_queries_tokens") == queries  # prefixd's own names too
    assert not any(name.startswith("vllm:") for name in own)  # --metrics-addr stays prefixd's


async def test_router_probes_need_no_token_while_the_api_does(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    async with running_server(tmp_path, http_addr="127.0.0.1:0", http_token_file=token_file) as server:
        async with httpx.AsyncClient() as client:
            probes = [(await client.get(url(server, p))).status_code
                      for p in ("/health", "/v1/loads", "/get_load", "/get_server_info", "/model_info", "/metrics")]
            models = (await client.get(url(server, "/v1/models"))).status_code
            tokenize = (await client.post(url(server, "/tokenize"), json={"prompt": "abc"})).status_code
    assert probes == [200] * 6
    assert models == tokenize == 401  # /tokenize carries a prompt


async def test_kv_event_probes_say_where_the_engine_publishes_only_while_it_does(tmp_path):
    pytest.importorskip("zmq")
    short = Path(tempfile.mkdtemp(prefix="kvw-", dir="/tmp"))  # ipc:// paths have ~107 bytes
    device = LetterDevice(num_lanes=2, num_pages=64, page_size=8, max_context=256)
    try:
        async with running_server(tmp_path, device, http_addr="127.0.0.1:0",
                                  kv_events=f"ipc://{short}/kv.sock?topic=kv@a@letters&layout=map",
                                  kv_events_replay=f"ipc://{short}/replay.sock") as server:
            async with httpx.AsyncClient() as client:
                sources = (await client.get(url(server, "/kv_event_sources"))).json()
                info = (await client.get(url(server, "/get_server_info"))).json()
        async with running_server(tmp_path / "off", http_addr="127.0.0.1:0") as server:
            async with httpx.AsyncClient() as client:
                off = (await client.get(url(server, "/kv_event_sources"))).status_code
                off_info = (await client.get(url(server, "/get_server_info"))).json()
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert sources == {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{short}/kv.sock",
                             "replay_endpoint": f"ipc://{short}/replay.sock", "topic": "kv@a@letters",
                             "buffer_steps": 10_000, "hwm": 10_000}}
    assert (info["kv_block_size"], info["page_size"]) == (8, 8)
    assert off == 404 and "kv_block_size" not in off_info


async def test_tokenize_gives_the_ids_a_generate_of_the_same_body_prefills(tmp_path):
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async with httpx.AsyncClient() as client:
            chat = (await client.post(url(server, "/tokenize"), json={"model": "letters", "messages": HI})).json()
            reply = (await client.post(url(server, "/v1/chat/completions"),
                                       json={"model": "letters", "messages": HI, "max_tokens": 2})).json()
            plain = (await client.post(url(server, "/tokenize"), json={"model": "letters", "prompt": "abc"})).json()
            refused = await client.post(url(server, "/tokenize"), json={"model": "letters", "messages": HI,
                                                                        "continue_final_message": True})
            other = await client.post(url(server, "/tokenize"), json={"model": "gpt-4", "prompt": "abc"})
    assert chat["count"] == len(chat["tokens"]) == reply["usage"]["prompt_tokens"]
    assert chat["max_model_len"] == server.device.info.max_context
    assert plain == {"count": 3, "max_model_len": server.device.info.max_context, "tokens": TOK.encode("abc")}
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    assert other.status_code == 404
