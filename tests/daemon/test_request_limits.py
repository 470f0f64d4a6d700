"""Per-request bounds through the socket (issue 8): stop strings, prompt plus max_tokens."""

from __future__ import annotations

import pytest

from prefixd.ipc.client import AsyncClient
from prefixd.ipc.errors import ClientError
from prefixd.ipc.messages import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.daemon.fakes import LetterDevice, letter_after
from tests.daemon.harness import running_server, wait_idle


async def test_too_many_stop_strings_is_refused_and_the_bound_still_matches(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            with pytest.raises(ClientError) as err:
                await client.generate(prompt="abc", max_tokens=4, stop=["zz"] * (MAX_STOP_STRINGS + 1)).collect()
            assert err.value.code == "bad_request"
            assert err.value.message == f"stop: {MAX_STOP_STRINGS + 1} stop strings; at most {MAX_STOP_STRINGS}"
            # The most a request may send: 127 long non-matching stops and one that matches.
            stops = [f"{i:03d}" + "q" * (MAX_STOP_CHARS - 3) for i in range(MAX_STOP_STRINGS - 1)] + ["ef"]
            result = await client.generate(prompt="abc", max_tokens=20, stop=stops).collect()
        assert (result.finish_reason, result.text) == ("stop", "cd")
        await wait_idle(server)


async def test_prompt_plus_max_tokens_past_the_context_is_clamped_with_a_note(tmp_path):
    """max_tokens is a ceiling: past the context the stream ends there, and says so."""
    async with running_server(tmp_path, LetterDevice(max_context=64)) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            clamped = await client.generate(prompt="p" * 60, max_tokens=100).collect()
            fits = await client.generate(prompt="q" * 60, max_tokens=4).collect()
            with pytest.raises(ClientError) as err:
                await client.generate(prompt="r" * 64, max_tokens=1).collect()
        expected = "".join(letter_after(59 + i) for i in range(4))
        assert (clamped.finish_reason, clamped.text, clamped.usage.completion_tokens) == ("length", expected, 4)
        assert clamped.note == ("stopped at the context: 60 prompt + 4 generated tokens fill max_context 64 "
                                "before max_tokens 100")
        assert (fits.finish_reason, fits.text, fits.note) == ("length", expected, None)
        assert err.value.code == "context_overflow"
        await wait_idle(server)


def test_message_count_is_checked_before_any_message_is_read():
    from prefixd.ipc.errors import ProtocolError
    from prefixd.ipc.messages import MAX_CHAT_MESSAGES, parse_request

    for kind in ("generate", "tokenize"):
        with pytest.raises(ProtocolError) as err:  # not-a-map items would fail first if each were read
            parse_request({"type": kind, "id": 1, "messages": [0] * (MAX_CHAT_MESSAGES + 1)})
        assert err.value.message == (f"messages: {MAX_CHAT_MESSAGES + 1} messages; "
                                     f"a conversation may hold at most {MAX_CHAT_MESSAGES}")
