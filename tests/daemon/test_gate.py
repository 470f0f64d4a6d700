"""One gate for every front: an HTTP caller is paced, seated and counted like a socket client,
a hostile HTTP caller changes no honest socket client's bits, and a short request does not
wait behind other clients' prefills."""

from __future__ import annotations

import anyio
import httpx
import pytest

from prefixd.front.bounds import ConnectionBounds
from prefixd.front.pacing import PaceLimits
from prefixd.ipc.client import AsyncClient
from tests.daemon.fakes import LetterDevice
from tests.daemon.harness import honest_beside, running_server, wait_idle


def url(server, path: str) -> str:
    return f"http://127.0.0.1:{server.http.port}/v1/{path}"


async def test_an_http_flood_is_paced_like_a_socket_client(tmp_path):
    """Ten credits a second, a burst of 20: a caller sending 60 cheap requests waits for its
    credits (the gate charges one a request), and a second caller, named apart, is not slowed."""
    bounds = ConnectionBounds(pace=PaceLimits(rate=10.0, burst=20))
    async with running_server(tmp_path, http_addr="127.0.0.1:0", bounds=bounds) as server:
        async with httpx.AsyncClient(timeout=60) as http:
            async def flood() -> None:
                for _ in range(60):
                    r = await http.post(url(server, "completions"), json={"prompt": "ab", "max_tokens": 1},
                                        headers={"x-prefixd-namespace": "flood"})
                    assert r.status_code == 200

            async with anyio.create_task_group() as tg:
                tg.start_soon(flood)
                with anyio.fail_after(60):
                    while ("http", "flood") not in server.gate.pacer.clients or \
                            server.gate.pacer.clients[("http", "flood")].counts.waits == 0:
                        await anyio.sleep(0.01)
                other = await http.post(url(server, "completions"), json={"prompt": "ab", "max_tokens": 1},
                                        headers={"x-prefixd-namespace": "calm"})
                assert other.status_code == 200
                assert server.gate.pacer.clients[("http", "calm")].counts.waits == 0
        await wait_idle(server)
    assert server.gate.pacer.totals.waits > 0


async def test_refused_http_requests_cost_their_caller_what_refused_socket_frames_do(tmp_path):
    """Ten credits a second, a burst of 20, a refusal costs 16: a caller sending bodies that are
    not JSON (400 before any gate step) is charged each and waits once in debt, on the
    OpenAI routes and the Anthropic one; a second caller, named apart, is not slowed."""
    bounds = ConnectionBounds(pace=PaceLimits(rate=10.0, burst=20, error_cost=16))
    async with running_server(tmp_path, http_addr="127.0.0.1:0", bounds=bounds) as server:
        bad = ("http", "bad")
        async with httpx.AsyncClient(timeout=60) as http:
            for _ in range(3):
                r = await http.post(url(server, "chat/completions"), content=b"{not json",
                                    headers={"x-prefixd-namespace": "bad", "content-type": "application/json"})
                assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
            counts = server.gate.pacer.clients[bad].counts
            assert (counts.frames, counts.errors) == (3, 3) and counts.waits >= 1
            r = await http.post(url(server, "messages"), json={"model": "default", "max_tokens": 1, "messages": []},
                                headers={"x-prefixd-namespace": "bad"})
            assert r.status_code == 400 and server.gate.pacer.clients[bad].counts.errors == 4  # the Anthropic route
            calm = await http.post(url(server, "completions"), json={"prompt": "ab", "max_tokens": 1},
                                   headers={"x-prefixd-namespace": "calm"})
            assert calm.status_code == 200
            assert server.gate.pacer.clients[("http", "calm")].counts.waits == 0
        await wait_idle(server)


async def test_http_generates_take_fair_seats_and_give_them_back(tmp_path):
    """Two lanes; an HTTP caller holds both with long streams. A socket client's generate is
    seated as soon as one frees, before the HTTP caller's third; every seat comes back."""
    device = LetterDevice(num_lanes=2, round_delay_s=0.002)
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0") as server:
        seats = server.gate.seats
        order: list[str] = []
        granted: list = []  # clients in the order their seats were granted
        take = seats.take

        async def recording_take(owner):
            await take(owner)
            granted.append(owner[0])  # the client: its path's first level

        seats.take = recording_take
        async with httpx.AsyncClient(timeout=60) as http:
            async def http_one(tag: str, tokens: int) -> None:
                r = await http.post(url(server, "completions"), json={"prompt": tag, "max_tokens": tokens},
                                    headers={"x-prefixd-namespace": "busy"})
                assert r.status_code == 200
                order.append(tag)

            async def socket_one() -> None:
                async with await AsyncClient.connect(server.socket_path) as client:
                    await client.generate(prompt="sock", max_tokens=2).collect()
                order.append("sock")

            async with anyio.create_task_group() as tg:
                tg.start_soon(http_one, "h1", 40)
                tg.start_soon(http_one, "h2", 40)
                with anyio.fail_after(30):
                    while seats.num_free:
                        await anyio.sleep(0.005)
                tg.start_soon(http_one, "h3", 2)
                with anyio.fail_after(30):
                    while seats.num_waiting < 1:
                        await anyio.sleep(0.005)
                tg.start_soon(socket_one)
                with anyio.fail_after(30):
                    while seats.num_waiting < 2:
                        await anyio.sleep(0.005)
        # the client holding none was seated first (seats, not completions: both then run
        # two tokens, and which reply lands first is a race)
        assert len(granted) == 4 and granted[0] == granted[1] == granted[3] != granted[2]
        assert sorted(order) == ["h1", "h2", "h3", "sock"]
        assert seats.num_free == 2 and seats.num_waiting == 0
        await wait_idle(server)


async def test_a_hostile_http_caller_leaves_honest_socket_bits_unchanged(tmp_path):
    """Malformed bodies, huge prompts, a stream left mid-way, and a flood of generates over
    HTTP, beside honest socket clients: their ids and logits digests equal those they get alone."""
    prompts = [f"honest {i} " * 3 for i in range(6)]
    async with running_server(tmp_path, http_addr="127.0.0.1:0") as server:
        async def honest() -> list[tuple]:
            async with await AsyncClient.connect(server.socket_path) as client:
                return [((r := await client.generate(prompt=p, max_tokens=8, logits=True, cache=False).collect()).ids,
                         r.logits_sha256) for p in prompts]

        alone = await honest()
        async with httpx.AsyncClient(timeout=60) as http:
            async def hostile() -> None:
                for i in range(30):
                    await http.post(url(server, "completions"), content=b"{not json")
                    await http.post(url(server, "completions"), json={"prompt": "x" * 5000, "max_tokens": 1})
                    await http.post(url(server, "chat/completions"), json={"messages": "no", "max_tokens": 2})
                    async with http.stream("POST", url(server, "completions"),
                                           json={"prompt": f"left {i}", "max_tokens": 50, "stream": True}) as r:
                        async for _ in r.aiter_lines():
                            break  # leaves mid-stream
                    await http.post(url(server, "completions"), json={"prompt": f"flood {i}", "max_tokens": 3})

            beside = await honest_beside(hostile, honest)
        assert beside == alone
        status = await wait_idle(server)
        assert status["lanes_busy"] == 0
        assert server.link.num_open_streams == 0 and server.gate.seats.num_free == server.gate.seats.num_seats


@pytest.mark.parametrize("front", ["socket", "http"])
async def test_a_short_request_is_not_kept_behind_other_clients_prefills(tmp_path, front):
    """Six other clients keep long prompts prefilling; each short request of another client is
    prefilled whole in one round, and that round gives the long prefills beside it at most the
    busy budget (SchedulerConfig.busy_prefill_rows), not their chunks: a short request waits
    for at most one short round before its own."""
    from prefixd.scheduler.config import SchedulerConfig

    device = LetterDevice(num_lanes=8, num_pages=2048, max_context=1024)
    rounds: list[list[tuple[tuple[int, ...], bool]]] = []
    run_round = device.run_round
    device.run_round = lambda plan: (rounds.append([(w.tokens, w.prefill) for w in plan.lanes]), run_round(plan))[1]
    honest_prompt = "hi there"
    honest_tokens = tuple(b + 3 for b in honest_prompt.encode())
    async with running_server(tmp_path, device, http_addr="127.0.0.1:0", lanes=8) as server:
        stop = anyio.Event()

        async def flood(i: int, http: httpx.AsyncClient) -> None:
            n = 0
            while not stop.is_set():
                prompt = f"{i} {n} " + "w" * 600
                if front == "http":
                    await http.post(url(server, "completions"), json={"prompt": prompt, "max_tokens": 1},
                                    headers={"x-prefixd-namespace": f"flood{i}"})
                else:
                    async with await AsyncClient.connect(server.socket_path) as client:
                        await client.generate(prompt=prompt, max_tokens=1).collect()
                n += 1

        async with httpx.AsyncClient(timeout=60) as http:
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(flood, i, http)
                with anyio.fail_after(30):
                    while (await server.link.status())["lanes_busy"] < 3:
                        await anyio.sleep(0.01)
                async with await AsyncClient.connect(server.socket_path) as honest:
                    for _ in range(5):
                        result = await honest.generate(prompt=honest_prompt, max_tokens=1, cache=False).collect()
                        assert result.finish_reason == "length"
                stop.set()
        await wait_idle(server)
    budget = SchedulerConfig(num_lanes=8).busy_prefill_rows
    honest_rounds = [r for r in rounds if any(prefill and tokens == honest_tokens for tokens, prefill in r)]
    assert len(honest_rounds) == 5  # each honest prompt prefilled whole, in one round
    for r in honest_rounds:
        others = sum(len(tokens) for tokens, prefill in r if prefill and tokens != honest_tokens)
        assert others <= budget, (others, budget)
