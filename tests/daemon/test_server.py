"""The daemon through its real socket: requests, streaming, stops, cancel, status, metrics."""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import urllib.request

import anyio
import numpy as np
import pytest

from prefixd.ipc.client import AsyncClient
from prefixd.ipc.errors import ClientError
from tests.daemon.fakes import ByteTokenizer, LetterDevice, letter_after
from tests.daemon.harness import running_server, wait_idle

TOK = ByteTokenizer()


def expected_letters(n_prompt: int, count: int) -> str:
    return "".join(letter_after(n_prompt - 1 + i) for i in range(count))


async def test_generate_streams_tokens_and_done_with_usage(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            result = await client.generate(prompt="hello", max_tokens=5).collect()
        assert result.text == expected_letters(5, 5)
        assert result.ids == tuple(TOK.encode(expected_letters(5, 5)))
        assert result.finish_reason == "length"
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (5, 5)
        assert result.usage.prefilled_tokens == 5
        await wait_idle(server)


async def test_the_tokenizer_is_warmed_before_the_daemon_listens(tmp_path):
    """The tokenizer's lazily built tables (the bytes of every id) are built at start, off the
    loop, so that the first request's tokens (and the streams beside it) never wait for them."""
    async with running_server(tmp_path) as server:
        assert server._builder.tokenizer.warmed


async def test_socket_and_directory_permissions(tmp_path):
    async with running_server(tmp_path) as server:
        assert stat.S_IMODE(os.lstat(server.socket_path).st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(server.socket_path.parent).st_mode) == 0o700
    assert not server.socket_path.exists()


async def test_stop_string_truncates_text_and_finishes_with_stop(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            # a 3-token prompt continues "cdefg..."; stop at "ef"
            result = await client.generate(prompt="abc", max_tokens=20, stop=["ef"]).collect()
        assert result.finish_reason == "stop"
        assert result.text == "cd"
        assert result.usage.completion_tokens == len(result.ids)
        assert TOK.decode(result.ids).startswith("cdef")
        await wait_idle(server)


async def test_stop_id_from_the_tokenizer_ends_the_stream(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            result = await client.generate(prompt="hi!", max_tokens=20).collect()
        assert result.finish_reason == "stop"
        assert result.ids == (0,)
        assert result.text == ""


async def test_chat_messages_use_message_starts_as_chunk_starts(tmp_path):
    async with running_server(tmp_path) as server:
        messages = [{"role": "user", "content": "hey"}]
        async with await AsyncClient.connect(server.socket_path) as client:
            tokens = await client.tokenize(messages=messages, add_special=False)
            result = await client.generate(messages=messages, max_tokens=3).collect()
        rendered = TOK.render_chat(messages)
        assert tokens.ids == rendered.ids
        assert tokens.message_starts == rendered.message_starts
        assert result.text == expected_letters(len(rendered.ids), 3)


async def test_cancel_ends_the_stream_with_cancelled_and_frees_the_lane(tmp_path):
    async with running_server(tmp_path) as server:
        server.device.round_delay_s = 0.002
        async with await AsyncClient.connect(server.socket_path) as client:
            async with client.generate(prompt="x", max_tokens=100000) as stream:
                first = await stream.__anext__()
                assert first.ids
                await stream.cancel()
                events = [e async for e in stream]
            assert events[-1].finish_reason == "cancelled"
            with pytest.raises(ClientError) as err:
                await client.cancel(12345)
            assert err.value.code == "not_found"
        status = await wait_idle(server)
        assert status["lanes_busy"] == 0


async def test_status_reports_lanes_model_and_connections(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            status = await client.status()
            hello = await client.hello()
        assert status["model"]["name"] == "letters"
        assert status["connections"] == 1
        assert len(status["lanes"]) == 4
        assert status["waiting"] == 0
        assert hello.version == 2 and hello.model["vocab_size"] == 259


async def test_hello_negotiates_version_2_and_a_generate_may_turn_drafting_off(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            assert (await client.hello(versions=(1,))).version == 1
            assert (await client.hello(versions=(1, 2, 7))).version == 2
            status = await client.status()
            async with client.generate(prompt="abc", max_tokens=2, draft="off") as stream:
                result = [e async for e in stream]
        assert status["draft"]["mode"] == "off"
        assert (result[-1].usage.draft_tokens, result[-1].usage.accepted_tokens) == (0, 0)


async def test_detokenize_and_logits_digests(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            assert await client.detokenize(TOK.encode("héllo")) == "héllo"
            result = await client.generate(tokens=[10, 11], max_tokens=2, logits=True).collect()
        assert result.logits_sha256 is not None and len(result.logits_sha256) == 2

        def digest(position: int) -> str:
            row = np.zeros(259, dtype=np.float32)
            row[position] = 1.0
            return hashlib.sha256(row.tobytes()).hexdigest()

        assert result.logits_sha256 == (digest(1), digest(2))


async def test_shutdown_closes_the_device_after_the_engine_thread_ends(tmp_path):
    device = LetterDevice()
    async with running_server(tmp_path, device) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            result = await client.generate(tokens=[10, 11], max_tokens=1).collect()
        assert len(result.ids) == 1 and not device.closed
    assert device.closed


async def test_metrics_endpoint_exposes_the_names_after_a_request(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            await client.generate(prompt="abc", max_tokens=4).collect()
        await wait_idle(server)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        body = await anyio.to_thread.run_sync(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    assert 'prefixd_requests_total{finish_reason="length"} 1.0' in body
    assert "prefixd_prompt_tokens_total 3.0" in body
    assert "prefixd_generation_tokens_total 4.0" in body
    assert 'prefixd_time_to_first_token_seconds_count{cache="miss"} 1.0' in body
    assert 'prefixd_time_to_first_token_seconds_count{cache="hit"} 0.0' in body
    assert "prefixd_inter_token_latency_seconds_count 3.0" in body
    for name in ("prefixd_round_duration_seconds_count", "prefixd_lanes_busy", "prefixd_requests_waiting",
                 "prefixd_prefix_cache_queries_tokens_total", "prefixd_prefix_cache_bytes"):
        assert name in body


async def test_graceful_exit_cancels_in_flight_streams_after_grace_and_sends_done(tmp_path):
    async with running_server(tmp_path, LetterDevice(round_delay_s=0.002), grace_s=0.05) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            async with client.generate(prompt="x", max_tokens=100000) as stream:
                await stream.__anext__()
                server.request_exit(0)
                events = [e async for e in stream]
        assert events[-1].finish_reason == "cancelled"


async def test_a_stop_id_ends_the_stream_and_its_text_is_not_shown(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            result = await client.generate(prompt="ab", max_tokens=20, stop_ids=[ord("d") + 3]).collect()
        assert result.ids == tuple(TOK.encode("bcd"))
        assert result.text == "bc"
        assert result.finish_reason == "stop"


async def test_notify_ready_after_listening_watchdog_pings_and_stopping(tmp_path):
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(tmp_path / "notify"))
    rx.setblocking(False)
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "20000"}
    seen: list[str] = []

    async def until(needle: str) -> None:
        while needle not in seen:
            await anyio.wait_readable(rx)
            seen.extend(rx.recv(4096).decode().split("\n"))

    with rx:
        async with running_server(tmp_path, env=env) as server:
            await until("READY=1")
            assert f"STATUS=listening on {server.socket_path}" in seen
            async with await AsyncClient.connect(server.socket_path) as client:
                await client.status()  # READY=1 came once the socket was listening
            seen.clear()
            await until("WATCHDOG=1")
            server.request_exit(0)
            await until("STOPPING=1")


async def test_the_event_loop_answers_while_a_round_is_stuck_in_the_device(tmp_path):
    async with running_server(tmp_path) as server:
        server.device.gate.clear()  # the engine thread blocks inside run_round
        async with await AsyncClient.connect(server.socket_path) as a, await AsyncClient.connect(server.socket_path) as b:
            async with a.generate(prompt="abc", max_tokens=2) as stream:
                while not server.device.waiting:  # the engine thread is parked inside run_round
                    await anyio.sleep(0.01)
                assert await b.detokenize(TOK.encode("still here")) == "still here"
                assert (await b.hello()).version == 2
                server.device.gate.set()
                result = [e async for e in stream]
        assert result[-1].finish_reason == "length"


async def test_a_failed_round_ends_its_streams_with_error_and_the_daemon_goes_on(tmp_path):
    device = LetterDevice()
    device.fail_rounds = True
    async with running_server(tmp_path, device) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            failed = await client.generate(prompt="abc", max_tokens=2).collect()
            device.fail_rounds = False
            ok = await client.generate(prompt="abc", max_tokens=2).collect()
        assert failed.finish_reason == "error"
        assert "planted device failure" in failed.note
        assert ok.text == "cd"
        await wait_idle(server)
    assert server.exit_code == 0


async def test_the_model_loads_on_the_thread_that_runs_its_rounds(tmp_path):
    """torch's OpenMP pool belongs to the thread that first ran a parallel op: a load on
    another thread that lives on keeps a second pool beside the rounds' (a forward then runs
    at about half speed on 2 cores, docs/benchmarks.md, Store). The engine loop loads and
    runs its rounds on one thread (in the daemon: the engine process's main thread)."""
    import threading

    from tests.daemon.fakes import LetterDevice, fake_runtime_factory

    device = LetterDevice()
    loaded_on: list[threading.Thread] = []
    rounds_on: set[threading.Thread] = set()
    run_round = device.run_round
    device.run_round = lambda plan: (rounds_on.add(threading.current_thread()), run_round(plan))[1]
    base = fake_runtime_factory(device)

    def recording(cfg, observer):
        loaded_on.append(threading.current_thread())
        return base(cfg, observer)

    async with running_server(tmp_path, device, runtime_factory=recording) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            assert (await client.generate(prompt="abc", max_tokens=3).collect()).text == "cde"
    assert len(loaded_on) == 1 and rounds_on == {loaded_on[0]}
    assert loaded_on[0] is not threading.main_thread()
