"""A chat render runs off the loop and is abandoned when its client goes (issue 8, defect 4):
another client's generate completes while a render is in progress, and a render whose client
disconnects stops with RenderCancelled instead of running to the end."""

from __future__ import annotations

import itertools
import threading

import anyio
import pytest

from prefixd.front.gate import HEAVY_MESSAGES
from prefixd.text.chat import ChatTemplate, RenderCancelled, render_conversation
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.errors import ClientError
from prefixd.ipc.transport import FramedStream
from tests.daemon import fakes
from tests.daemon.harness import running_server, wait_idle

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


class GatedChatTokenizer(fakes.ByteTokenizer):
    """Renders with the real render_conversation; its first poll of should_stop waits for the
    test, then waits (bounded) until the connection's probe reports the client gone."""

    def __init__(self) -> None:
        self.wait_for_gone = True
        self.started = threading.Event()
        self.release = threading.Event()
        self.outcome: list[str] = []

    def offsets_bytes(self, ids):
        return [0, *itertools.accumulate(len(self.token_bytes(i)) for i in ids)]

    def render_chat(self, messages, *, add_generation_prompt=True, tools=None, should_stop=None):
        if should_stop is None:
            return super().render_chat(messages, add_generation_prompt=add_generation_prompt)

        def gated() -> bool:
            if not self.started.is_set():
                self.started.set()
                self.release.wait(10)
                for _ in range(1000 if self.wait_for_gone else 0):  # up to ~5 s for the hang-up to show
                    if should_stop():
                        return True
                    threading.Event().wait(0.005)
            return should_stop()

        try:
            out = render_conversation(ChatTemplate(TEMPLATE), messages, self,
                                      add_generation_prompt=add_generation_prompt, should_stop=gated)
        except RenderCancelled:
            self.outcome.append("cancelled")
            raise
        self.outcome.append("finished")
        return out


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> GatedChatTokenizer:
    tok = GatedChatTokenizer()
    monkeypatch.setattr(fakes, "ByteTokenizer", lambda: tok)
    return tok


async def test_render_runs_off_the_loop_and_stops_when_its_client_goes(tmp_path, gated):
    # A light render (a worker thread; a heavy one runs in a worker process: test_heavy.py)
    messages = [{"role": "user", "content": f"m{i}"} for i in range(HEAVY_MESSAGES)]
    async with running_server(tmp_path) as server:
        renderer = await FramedStream.connect(server.socket_path)
        await renderer.send({"type": "generate", "id": 1, "messages": messages, "max_tokens": 2})
        await anyio.to_thread.run_sync(gated.started.wait, 10)
        # The render is in progress (held at its first poll); another client is served meanwhile.
        async with await AsyncClient.connect(server.socket_path) as other:
            result = await other.generate(tokens=[5, 6, 7], max_tokens=3).collect()
        assert result.finish_reason == "length" and len(result.ids) == 3
        assert gated.outcome == []
        await renderer.aclose()
        gated.release.set()
        with anyio.fail_after(10):
            while not gated.outcome:
                await anyio.sleep(0.01)
        assert gated.outcome == ["cancelled"]
        await wait_idle(server)


async def test_render_of_a_present_client_finishes(tmp_path, gated):
    gated.wait_for_gone = False
    gated.release.set()
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            tokens = await client.tokenize(messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}])
        assert gated.outcome == ["finished"]
        assert tokens.message_starts == (0, len("<user>hi\n"), len("<user>hi\n<user>yo\n"))
        await wait_idle(server)


async def test_too_many_messages_is_a_clear_bad_request(tmp_path):
    from prefixd.text.chat import MAX_CHAT_MESSAGES

    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            with pytest.raises(ClientError) as err:
                await client.tokenize(messages=[{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1))
        assert err.value.code == "bad_request"
        assert err.value.message == (f"messages: {MAX_CHAT_MESSAGES + 1} messages; "
                                     f"a conversation may hold at most {MAX_CHAT_MESSAGES}")
