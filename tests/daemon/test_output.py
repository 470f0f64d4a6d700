"""The output processor (one output path) and what a stop string leaves in the lane."""

from __future__ import annotations

from prefixd.front.output import OutputProcessor
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.events import DoneEvent, TokenEvent
from prefixd.scheduler.streams import TokenEvent as StreamTokens
from prefixd.scheduler.streams import Usage as EngineUsage
from tests.daemon.fakes import ByteDecoder, ByteTokenizer
from tests.daemon.harness import idle_engine, running_server, wait_idle

TOK = ByteTokenizer()


class _Done:
    def __init__(self, reason: str, completion: int) -> None:
        self.finish_reason = reason
        self.usage = EngineUsage(prompt_tokens=3, cached_tokens=0, prefilled_tokens=3, completion_tokens=completion,
                                 cache="miss", ttft_s=0.5, total_s=1.0)
        self.note = None


def processor(**kwargs) -> OutputProcessor:
    return OutputProcessor(7, ByteDecoder(TOK), token_bytes=TOK.token_bytes, **kwargs)


def test_stop_string_across_rounds_keeps_the_tokens_before_it():
    out = processor(stop=("ef",))
    events = [out.tokens(StreamTokens(1, tuple(TOK.encode(piece)))) for piece in ("cd", "e", "fg", "h")]
    assert [e.text if e else None for e in events] == ["cd", "", "", None]
    assert out.stop_hit and out.keep_generated == 2
    final = out.done(_Done("length", 9))
    assert final == [DoneEvent(7, "stop", final[-1].usage)]
    # the ids sent: "cd", "e", then "f", which completes the stop ("g" is past it); not 9
    assert (final[-1].usage.completion_tokens, final[-1].usage.cache) == (4, "miss")


def test_a_reply_cut_by_a_stop_string_is_the_same_however_its_tokens_were_grouped():
    """Rounds may deliver several tokens in one event (drafted rounds, the stream interval):
    the reply's ids, text, digests and usage end at the token that completes the stop."""
    ids = tuple(TOK.encode("abcdefgh"))
    digests = tuple(f"{i:064x}" for i in range(len(ids)))

    def run(groups):
        out, sent, at = processor(stop=("ef",)), [], 0
        for n in groups:
            event = out.tokens(StreamTokens(1, ids[at:at + n], digests[at:at + n]))
            at += n
            if event is not None:
                sent.append(event)
        done = out.done(_Done("length", len(ids)))[-1]
        return ([i for e in sent for i in e.ids], "".join(e.text for e in sent),
                [d for e in sent for d in e.logits_sha256], done.usage.completion_tokens, out.keep_generated)

    one_by_one = run([1] * len(ids))
    assert one_by_one == (list(TOK.encode("abcdef")), "abcd", list(digests[:6]), 6, 4)
    assert run([len(ids)]) == one_by_one
    assert run([3, 4, 1]) == one_by_one


def test_stop_ids_are_sent_as_ids_but_not_as_text_and_usage_passes_through():
    out = processor(stop_ids=frozenset({0}))
    token = out.tokens(StreamTokens(1, (*TOK.encode("ok"), 0), ("a" * 64,) * 3))
    assert token == TokenEvent(7, (*TOK.encode("ok"), 0), "ok", ("a" * 64,) * 3)
    [done] = out.done(_Done("stop", 3))
    assert done.to_wire() == {"type": "done", "id": 7, "finish_reason": "stop", "usage": {
        "prompt_tokens": 3, "cached_tokens": 0, "prefilled_tokens": 3, "completion_tokens": 3,
        "ttft_s": 0.5, "total_s": 1.0, "cache": "miss", "draft_tokens": 0, "accepted_tokens": 0}}


async def test_a_turn_cut_by_a_stop_string_leaves_only_rows_the_next_turn_repeats(tmp_path):
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            # a 3-token prompt continues "cdefg..."; the reply is "cd"
            first = await client.generate(prompt="abc", max_tokens=20, stop=["ef"]).collect()
            assert (first.text, first.finish_reason) == ("cd", "stop")
            await wait_idle(server)
            lanes = [(lane.ids, lane.resident) for lane in idle_engine(server).lanes]
            assert lanes[0] == (TOK.encode("abccd"), True)
            second = await client.generate(prompt="abccd!next", max_tokens=1).collect()
        assert (second.usage.cache, second.usage.cached_tokens) == ("resident", 5)
        await wait_idle(server)
