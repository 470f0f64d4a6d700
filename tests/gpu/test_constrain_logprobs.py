"""Schema-constrained output and logprobs through the real engine and runner (tiny random
llama, CPU): every reply matches its schema over many seeds; constrained streams give the
same ids cold, resumed, and beside 7 other lanes; logprobs come from the sampled fp32 row."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from prefixd.front.requests import RequestBuilder  # noqa: E402
from prefixd.gpu import runner as runner_module  # noqa: E402
from prefixd.gpu.constrain import GrammarMask  # noqa: E402
from prefixd.gpu.loading import load_checkpoint  # noqa: E402
from prefixd.gpu.runner import ModelRunner  # noqa: E402
from prefixd.ipc.errors import ProtocolError  # noqa: E402
from prefixd.ipc.framing import Limits  # noqa: E402
from prefixd.scheduler.config import SchedulerConfig  # noqa: E402
from prefixd.scheduler.engine import Engine  # noqa: E402
from prefixd.gpu.digest import logits_sha256  # noqa: E402
from prefixd.scheduler.records import LaneWork, RoundPlan, SamplingParams  # noqa: E402
from prefixd.scheduler.streams import DoneEvent, StreamRequest, TokenEvent  # noqa: E402
from prefixd.text.grammar import grammar_of  # noqa: E402
from prefixd.text.tools import parse_tool_calls  # noqa: E402
from tests.helpers.tiny_models import make_tiny_hf_dir  # noqa: E402

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "ok", "n"], "properties": {
    "city": {"enum": ["Paris", "Oslo", "Rome"]}, "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = tmp_path_factory.mktemp("llama")
    make_tiny_hf_dir(path, "llama", seed=1, tie_word_embeddings=True, num_hidden_layers=2)
    ckpt = load_checkpoint(path, device=CPU, dtype=torch.float32)
    return ModelRunner(ckpt, device=CPU, dtype=torch.float32, num_lanes=8, num_pages=160, page_size=8)


def run(engine: Engine, requests: list[StreamRequest], events: list | None = None) -> dict[int, tuple[int, ...]]:
    for r in requests:
        engine.submit(r)
    ids: dict[int, list[int]] = {r.stream_id: [] for r in requests}
    while not engine.idle:
        for event in engine.step():
            if isinstance(event, TokenEvent):
                ids.setdefault(event.stream_id, []).extend(event.ids)
                if events is not None:
                    events.append(event)
    return {k: tuple(v) for k, v in ids.items()}


def request(stream_id: int, prompt: tuple[int, ...], seed: int, grammar: str | None, stop: frozenset[int]) -> StreamRequest:
    sampling = SamplingParams(temperature=1.0, seed=seed, grammar=grammar)
    return StreamRequest(stream_id, prompt, 40, sampling=sampling, stop_ids=stop)


def text_of(runner: ModelRunner, ids: tuple[int, ...]) -> str:
    return runner.tokenizer.decode([i for i in ids if i not in runner.tokenizer.stop_ids])


def test_replies_match_the_schema_over_many_seeds(runner):
    engine = Engine(runner, SchedulerConfig(num_lanes=8, grid=8, cache=False))
    grammar = grammar_of(FORMAT)
    stop = frozenset(runner.tokenizer.stop_ids)
    prompt = tuple(runner.tokenizer.encode("Give me the weather as JSON:"))
    out = run(engine, [request(s, prompt, s, grammar, stop) for s in range(12)])
    for ids in out.values():
        assert ids[-1] in stop  # the grammar ended the reply, not max_tokens
        value = json.loads(text_of(runner, ids))
        assert set(value) == {"city", "ok", "n"} and value["city"] in ("Paris", "Oslo", "Rome")
        assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    assert len(set(out.values())) > 3  # sampling still varies within the schema


def test_constrained_ids_are_the_same_cold_resumed_and_beside_seven_lanes(runner):
    grammar = grammar_of({"type": "regex", "regex": "[a-z ]{4,30}\\."})
    stop = frozenset(runner.tokenizer.stop_ids)
    prompt = tuple(runner.tokenizer.encode("A short sentence in lower case, please:"))
    engine = Engine(runner, SchedulerConfig(num_lanes=8, grid=8, cache=True))
    cold = run(engine, [request(1, prompt, 7, grammar, stop)])[1]
    resumed = run(engine, [request(2, prompt, 7, grammar, stop)])[2]
    others = [request(10 + k, tuple(runner.tokenizer.encode(f"other prompt {k}")), k, grammar_of(FORMAT), stop)
              for k in range(7)]
    beside = run(Engine(runner, SchedulerConfig(num_lanes=8, grid=8, cache=False)),
                 [*others, request(3, prompt, 7, grammar, stop)])[3]
    assert cold == resumed == beside
    text = text_of(runner, cold)
    assert text.endswith(".") and set(text[:-1]) <= set("abcdefghijklmnopqrstuvwxyz ")


def test_forced_tool_call_parses(runner):
    builder = RequestBuilder(runner.tokenizer, {"vocab_size": runner.info.vocab_size}, Limits())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    built = builder.generate({"type": "generate", "id": 1, "messages": [{"role": "user", "content": "weather?"}],
                              "tools": tools, "tool_choice": "required", "max_tokens": 40,
                              "sampling": {"temperature": 1.0, "seed": 3}}, 1)
    engine = Engine(runner, SchedulerConfig(num_lanes=8, grid=8, cache=False))
    ids = run(engine, [built.request])[1]
    _, calls = parse_tool_calls(text_of(runner, ids))
    assert [c.name for c in calls] == ["get_weather"] and json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")


def test_an_unsatisfiable_schema_is_a_bad_request(runner):
    builder = RequestBuilder(runner.tokenizer, {"vocab_size": runner.info.vocab_size}, Limits())
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]}
    with pytest.raises(ProtocolError) as info:
        builder.generate({"type": "generate", "id": 1, "prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"schema": schema}}}, 1)
    assert info.value.code.value == "bad_request"
    assert info.value.message.startswith("response_format: Unsatisfiable schema")


def logprob_run(engine: Engine, stream_id: int, prompt: tuple[int, ...]) -> list:
    events: list = []
    sampling = SamplingParams(temperature=0.8, seed=5, logprobs=3)
    run(engine, [StreamRequest(stream_id, prompt, 6, sampling=sampling, want_logits=True)], events)
    return [e for e in events if e.stream_id == stream_id]


def sampled_rows(runner: ModelRunner, prompt: tuple[int, ...], ids: list[int]) -> torch.Tensor:
    """The fp32 logits rows `ids` were sampled from, recomputed in one prefill chunk (rows are
    row-invariant, so their bits equal the engine's)."""
    tokens = prompt + tuple(ids[:-1])
    first = len(prompt) - 1
    work = LaneWork(0, 0, tokens, tuple(range(-(-len(tokens) // runner.info.page_size))), True,
                    logits_rows=tuple(range(first, len(tokens))))
    return runner.run_round(RoundPlan((work,))).lanes[0].logits


def test_logprobs_come_from_the_sampled_row_and_hold_cold_resumed_and_beside_others(runner):
    prompt = tuple(runner.tokenizer.encode("Count: one two three"))
    engine = Engine(runner, SchedulerConfig(num_lanes=8, grid=8, cache=True))
    cold = logprob_run(engine, 1, prompt)
    assert len(cold) == 6
    resumed = logprob_run(engine, 2, prompt)
    crowded = Engine(runner, SchedulerConfig(num_lanes=8, grid=8, cache=False))
    for k in range(7):
        crowded.submit(StreamRequest(10 + k, tuple(runner.tokenizer.encode(f"noise {k}")), 6,
                                     sampling=SamplingParams(temperature=1.0, seed=k, logprobs=2)))
    beside = logprob_run(crowded, 3, prompt)
    key = lambda events: [(e.ids, e.logprobs) for e in events]  # noqa: E731
    assert key(cold) == key(resumed) == key(beside)
    rows = sampled_rows(runner, prompt, [e.ids[0] for e in cold])  # the engines are done with the pool
    assert logits_sha256(rows) == tuple(d for e in cold for d in e.logits_sha256)  # the very rows sampled from
    for event, raw in zip(cold, rows, strict=True):
        [token], [lp] = event.ids, event.logprobs
        row = torch.log_softmax(raw.float(), dim=0)
        assert lp.logprob == float(row[token])
        values, ids = torch.sort(row, descending=True, stable=True)
        assert lp.top == tuple((int(i), float(v)) for i, v in zip(ids[:3].tolist(), values[:3].tolist()))


class _BackgroundMask(GrammarMask):
    """The runner's mask with each next mask built on the worker thread (as on an accelerator)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "background": True})


def digests(engine: Engine, requests: list[StreamRequest]) -> dict[int, tuple]:
    """Per stream: its ids, and the sha256 of every logits row it was sampled from."""
    events: list = []
    ids = run(engine, requests, events)
    rows: dict[int, list[str]] = {}
    for e in events:
        rows.setdefault(e.stream_id, []).extend(e.logits_sha256)
    return {k: (ids[k], tuple(rows.get(k, ()))) for k in ids}


def test_masks_built_on_the_worker_give_the_same_ids_and_logits_as_inline(runner, monkeypatch):
    stop = frozenset(runner.tokenizer.stop_ids)
    grammars = [grammar_of(FORMAT), grammar_of({"type": "regex", "regex": "[a-z ]{4,30}\\."}), None]
    prompt = tuple(runner.tokenizer.encode("Give me the weather as JSON:"))

    def requests() -> list[StreamRequest]:
        return [StreamRequest(s, prompt, 24, sampling=SamplingParams(temperature=1.0, seed=s, grammar=grammars[s % 3]),
                              stop_ids=stop, want_logits=True) for s in range(16)]

    inline = digests(Engine(runner, SchedulerConfig(num_lanes=8, grid=8, cache=False)), requests())
    monkeypatch.setattr(runner_module, "GrammarMask", _BackgroundMask)
    worker = digests(Engine(runner, SchedulerConfig(num_lanes=8, grid=8, cache=False)), requests())
    assert worker == inline
    assert all(len(rows) == len(ids) for ids, rows in inline.values())
    assert len({ids for ids, _ in inline.values()}) > 8  # seeds still vary the replies


def run_to_done(engine: Engine, requests: list[StreamRequest]) -> tuple[dict[int, tuple[int, ...]], dict[int, str]]:
    """Every stream's ids and its finish reason."""
    for r in requests:
        engine.submit(r)
    ids: dict[int, tuple[int, ...]] = {r.stream_id: () for r in requests}
    reasons: dict[int, str] = {}
    while not engine.idle:
        for event in engine.step():
            if isinstance(event, TokenEvent):
                ids[event.stream_id] += event.ids
            elif isinstance(event, DoneEvent):
                reasons[event.stream_id] = event.finish_reason
    return ids, reasons


@pytest.mark.parametrize("mask_class", [GrammarMask, _BackgroundMask])
def test_a_lane_whose_grammar_ends_or_fails_mid_batch_ends_alone(runner, monkeypatch, mask_class):
    stop = frozenset(runner.tokenizer.stop_ids)
    short = grammar_of({"type": "regex", "regex": "[a-z]{3}"})  # done after 3 letters: only the end follows
    broken = grammar_of({"type": "regex", "regex": "[a-z]{40,50}"})  # its third mask fails

    class FailsOnItsThirdMask(mask_class):
        calls = 0

        def _unpack(self, live):  # every way a mask is built (alone, batched, on the worker) ends here
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("the grammar library failed")
            return super()._unpack(live)

    def make_mask(ll_tok, grammar, **kwargs):
        return (FailsOnItsThirdMask if grammar == broken else mask_class)(ll_tok, grammar, **kwargs)

    monkeypatch.setattr(runner_module, "GrammarMask", make_mask)
    long_grammar = grammar_of({"type": "regex", "regex": "[a-z ]{200}"})

    def req(stream_id: int, grammar: str | None) -> StreamRequest:
        prompt = tuple(runner.tokenizer.encode(f"lane {stream_id} says:"))
        sampling = SamplingParams(temperature=1.0, seed=stream_id, grammar=grammar)
        return StreamRequest(stream_id, prompt, 12, sampling=sampling, stop_ids=stop)

    others = [req(k, long_grammar if k % 2 else None) for k in range(6)]
    solo = {r.stream_id: run(Engine(runner, SchedulerConfig(num_lanes=8, grid=8, cache=False)), [r])[r.stream_id]
            for r in others}
    engine = Engine(runner, SchedulerConfig(num_lanes=8, grid=8, cache=False))
    ids, reasons = run_to_done(engine, [*others, req(100, short), req(101, broken)])
    assert reasons[100] == "stop" and ids[100][-1] in stop
    text = text_of(runner, ids[100])
    assert len(text) == 3 and set(text) <= set("abcdefghijklmnopqrstuvwxyz")
    assert reasons[101] == "error" and len(ids[101]) == 2
    assert {k: ids[k] for k in solo} == solo and all(reasons[k] == "length" for k in solo)
