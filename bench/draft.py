"""Drafting benchmark: decode tok/s with n-gram drafts against without, beside llama.cpp.

    python bench/draft.py                     # 1 and 8 lanes, 128 tokens per reply, modes int4 and invariant
    python bench/draft.py --quick             # 1 lane and 2 lanes, 48 tokens per reply
    python bench/draft.py --modes int4 --draft-max 8 --threads 2
    python bench/draft.py --modes int4 --lanes 8 --workloads echo --repeat 3   # medians of 3 alternating runs
    python bench/draft.py --modes int4 --verify-cost    # only: what a verify row costs, and the rate it bounds
    python bench/draft.py --modes int4 --sampling greedy,defaults   # also under the CLI's default sampling

Two workloads built from this repository's own text, rendered with the model's chat template:
- echo: agent-style turns: a tool listing whose paths the reply must quote back in tool calls,
  and a source function asked back with one line changed (the reply re-emits most of what
  the prompt holds); each conversation holds one earlier exchange of the same kind, answered;
- prose: a request for new prose about a topic (the reply repeats little).

Each workload is `--turns` requests (default 8), run `lanes` at a time: at 1 lane one after
another, at 8 lanes all together. For each runner mode, workload and lane count: decode tok/s
undrafted and drafted (tokens after every lane's first token of a batch, over the time since
then until its last lane ended, summed over batches), the same over each batch's busy span
(until its first lane ended: every lane decoding; a batch's makespan is its slowest reply's, and
a reply that drafts little finishes last, on a few lanes, so the busy span is what "at 8
lanes" measures), acceptance (accepted / drafted tokens), mean accepted drafts per verify,
and whether the token ids of both runs are equal (they must be). `--sampling` picks how replies
are sampled: `greedy`, and `defaults`, what `prefixd chat` uses for the model (its own settings,
else temperature 0.7, top-p 0.9, top-k 40), with a fixed seed per turn (so drafted and undrafted
runs sample the same tokens: a draft is kept only where the seeded sample of its row equals it).
Beside them, llama.cpp (llama-cpp-python) on the same GGUF with and without its
prompt-lookup drafting (`LlamaPromptLookupDecoding`), one sequence, greedy.

With --verify-cost, instead: per runner mode and lane count, the median time of a round in
which every lane, at --verify-context tokens of context, brings its last token and k drafts
(k = 0..--draft-max; every row sampled, so each row costs what a verify row costs), and what
that bounds: with each draft kept with chance --verify-accept once the ones before it were
(a lane's tokens a round 1 + p + ... + p^k), the rate against k = 0. No policy can beat the
best of those rates while every lane drafts.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import fmt_rate, fmt_ratio, markdown_table, print_machine  # noqa: E402
from prefixd.daemon.config import DEFAULT_DRAFT_MAX  # noqa: E402
from prefixd.scheduler.records import SamplingParams  # noqa: E402
from prefixd.scheduler.streams import DoneEvent, StreamRequest, TokenEvent  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["a lighthouse keeper", "a night train", "a city garden", "an old map", "a winter market",
          "a river ferry", "a mountain radio", "a quiet library"]


def functions(limit: int) -> list[str]:
    """Source of small functions of this repository (8-30 lines)."""
    out = []
    for path in sorted((ROOT / "prefixd" / "scheduler").glob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno <= 30:
                out.append(textwrap.dedent(ast.get_source_segment(text, node, padded=True)))
    return out[:limit]


def source_paths() -> list[str]:
    """This repository's Python files, relative to its root."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "prefixd").rglob("*.py"))


TOOL_INSTRUCTION = ("Call the read_file tool once for every file listed, in order. Reply only with the calls, one "
                    'JSON object a line: {"name": "read_file", "arguments": {"path": "..."}}')


def listing_exchange(i: int) -> tuple[dict, dict]:
    """A user turn holding a `list_files` result, and the reply that calls `read_file` on each path."""
    paths = source_paths()
    picked = paths[i * 5 % len(paths): i * 5 % len(paths) + 6]
    user = {"role": "user", "content": "The list_files tool returned:\n"
            f"{json.dumps({'files': picked}, indent=1)}\n\n{TOOL_INSTRUCTION}"}
    calls = "\n".join(json.dumps({"name": "read_file", "arguments": {"path": p}}) for p in picked)
    return user, {"role": "assistant", "content": calls}


def edit_exchange(i: int) -> tuple[dict, dict]:
    """A user turn asking for a function back with a comment added, and that function changed."""
    fns = functions(64)
    lines = fns[i * 7 % len(fns)].splitlines()
    second = lines[1]
    user = {"role": "user", "content": "Here is a function from the file:\n\n" + "\n".join(lines) + "\n\n"
            f"Apply this change: add a comment above the line `{second.strip()}` saying why it is there. "
            "Reply with the whole function, changed, and nothing else."}
    indent = second[: len(second) - len(second.lstrip())]
    changed = "\n".join([lines[0], f"{indent}# kept: the callers rely on it", *lines[1:]])
    return user, {"role": "assistant", "content": changed}


def echo_messages(i: int) -> list[dict]:
    """An agent conversation whose reply must quote back what the prompt holds: odd turns call a
    tool on the paths of a listing, even turns re-emit a function with one line added. Each
    holds one earlier exchange of the same kind (another listing or function, answered), as
    an agent's context does; without it the small default model answers such turns in prose."""
    exchange = listing_exchange if i % 2 else edit_exchange
    earlier_user, earlier_reply = exchange(i + 2)
    return [earlier_user, earlier_reply, exchange(i)[0]]


def prose_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a short original story about {TOPICS[i % len(TOPICS)]}."}]


WORKLOADS = {"echo": echo_messages, "prose": prose_messages}


class DraftCounts:
    """An engine observer counting verifies (drafts checked) for the mean accepted length."""

    def __init__(self) -> None:
        self.verifies = 0

    def on_draft(self, num_drafted: int, num_accepted: int) -> None:
        self.verifies += 1

    def __getattr__(self, name: str):  # every other observer call: nothing to do
        return lambda *args, **kwargs: None


def run_turns(runner, tokenizer, workload, lanes: int, turns: int, max_tokens: int, draft: str, draft_max: int,
              sampling: dict | None = None):
    """`turns` requests (workload(0..turns-1); at least `lanes`), `lanes` at a time, each batch run to its end:
    token ids and usage per request, decode tok/s over all batches, verifies."""
    ids, usage, verifies = {}, {}, 0
    whole, busy = Rate(), Rate()
    turns = max(turns, lanes)  # every lane busy
    for first in range(0, turns, lanes):
        batch = [i for i in range(first, min(first + lanes, turns))]
        b_ids, b_usage, b_whole, b_busy, b_verifies = run_engine(
            runner, tokenizer, workload, batch, max_tokens, draft, draft_max, sampling)
        ids.update(b_ids)
        usage.update(b_usage)
        whole.add(b_whole)
        busy.add(b_busy)
        verifies += b_verifies
    return ids, usage, whole.rate, busy.rate, verifies


@dataclasses.dataclass
class Rate:
    """Tokens over seconds, summed over batches."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, other: "Rate") -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def run_engine(runner, tokenizer, workload, turns: list[int], max_tokens: int, draft: str, draft_max: int,
               sampling: dict | None = None):
    """One engine with a lane per turn (sampled with `sampling`, seeded by turn; None: greedy):
    token ids and usage per turn, the decode `Rate` of the
    batch (tokens emitted after every lane's first token, over the seconds since then until the
    last lane ended), that of its busy span (the same until the first lane ended: every lane
    decoding), and the number of verifies."""
    lanes = len(turns)
    from prefixd.scheduler.config import SchedulerConfig
    from prefixd.scheduler.engine import Engine

    counts = DraftCounts()
    engine = Engine(runner, SchedulerConfig(num_lanes=lanes, cache=False, draft=draft, draft_max=draft_max),
                    observer=counts)
    for i in turns:
        tokens = tuple(tokenizer.render_chat(workload(i)).ids)
        params = SamplingParams(**sampling, seed=1000 + i) if sampling else SamplingParams()
        engine.submit(StreamRequest(i, tokens, max_tokens, sampling=params,
                                    stop_ids=frozenset(tokenizer.stop_ids)))
    ids: dict[int, list[int]] = {i: [] for i in turns}
    usage = {}
    t_all_started = None
    whole, busy = Rate(), None
    while not engine.idle:
        for ev in engine.step():
            if isinstance(ev, TokenEvent):
                ids[ev.stream_id] += ev.ids
                if t_all_started is not None:
                    whole.tokens += len(ev.ids)
            elif isinstance(ev, DoneEvent):
                usage[ev.stream_id] = ev.usage
        now = time.perf_counter()
        if busy is None and usage:  # the first lane ended this step (none busy span: before all started)
            busy = Rate(whole.tokens, now - t_all_started) if t_all_started is not None else Rate()
        if t_all_started is None and all(ids.values()):
            t_all_started = now
    if t_all_started is not None:
        whole.seconds = time.perf_counter() - t_all_started
    return ids, usage, whole, busy or Rate(), counts.verifies


def llama_cpp_rates(path: str, tokenizer, workload, turns: int, max_tokens: int,
                    draft_max: int, sampling: dict | None = None) -> tuple[float | None, float | None]:
    """llama.cpp's decode tok/s over the workload's turns, one at a time (greedy, or `sampling`
    seeded by turn): without and with `LlamaPromptLookupDecoding` (None, None without
    llama-cpp-python)."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None, None
    rates = []
    for draft in (None, LlamaPromptLookupDecoding(num_pred_tokens=draft_max)):
        # with a draft model llama-cpp-python keeps logits for every row (its verify reads them),
        # and its score buffer must then hold the whole context (logits_all)
        llm = Llama(model_path=path, n_ctx=4096, n_threads=torch.get_num_threads(), verbose=False, draft_model=draft,
                    logits_all=draft is not None)
        tokens_n, decode_s = 0, 0.0
        for i in range(turns):
            tokens = list(tokenizer.render_chat(workload(i)).ids)
            llm.reset()
            t0 = time.perf_counter()
            llm.create_completion(tokens, max_tokens=1, temperature=0.0)
            prefill_s = time.perf_counter() - t0
            llm.reset()
            kw = {"temperature": 0.0}
            if sampling:
                kw = {"temperature": sampling.get("temperature", 0.0), "top_p": sampling.get("top_p", 1.0),
                      "top_k": sampling.get("top_k", 0), "min_p": sampling.get("min_p", 0.0),
                      "repeat_penalty": sampling.get("repetition_penalty", 1.0), "seed": 1000 + i}
            t0 = time.perf_counter()
            out = llm.create_completion(tokens, max_tokens=max_tokens, **kw)
            decode_s += max(time.perf_counter() - t0 - prefill_s, 1e-9)
            tokens_n += out["usage"]["completion_tokens"] - 1
        rates.append(tokens_n / decode_s)
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--modes", default="int4,invariant", help="runner modes, comma-separated ('': none)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp rows")
    parser.add_argument("--draft-max", type=int, default=DEFAULT_DRAFT_MAX)
    parser.add_argument("--drafter", default="ngram", choices=("ngram", "mtp"),
                        help="mtp: the model's MTP head (the undrafted rows run without the head)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--lanes", default="", help="lane counts, comma-separated (default: 1,8; --quick: 1,2)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per row, undrafted and drafted alternating; the table shows medians")
    parser.add_argument("--workloads", default="echo,prose", help="workloads, comma-separated")
    parser.add_argument("--sampling", default="greedy",
                        help="greedy and/or defaults (prefixd chat's for the model), comma-separated")
    parser.add_argument("--turns", type=int, default=0,
                        help="requests per workload, run lanes at a time (default: 8; --quick: 2)")
    parser.add_argument("--verify-cost", action="store_true",
                        help="only the verify-round cost table (see above), no workloads")
    parser.add_argument("--verify-context", type=int, default=1000, help="context of each lane for --verify-cost")
    parser.add_argument("--verify-accept", type=float, default=0.85,
                        help="chance a draft is kept, given the ones before it were, for --verify-cost")
    args = parser.parse_args()
    from prefixd.gpu.default_model import default_model_path
    from prefixd.gpu.families import resolve_mode
    from prefixd.gpu.loading import load_checkpoint
    from prefixd.gpu.runner import ModelRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    lane_counts, max_tokens = ((1, 2), 48) if args.quick else ((1, 8), 128)
    turns = args.turns or (2 if args.quick else 8)
    if args.lanes:
        lane_counts = tuple(int(n) for n in args.lanes.split(","))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = tiny_mtp_dir() if args.model == "tiny-mtp" else args.model
    ckpt = load_checkpoint(model, device=torch.device("cpu"), dtype=dtype)
    tok = ckpt.tokenizer
    print_machine({"model": str(ckpt.path), "dtype": args.dtype, "reply tokens": str(max_tokens),
                   "draft max": str(args.draft_max), "torch threads": str(torch.get_num_threads()),
                   "drafter": args.drafter, "repeat": str(args.repeat)})
    if args.verify_cost:
        for mode in [m for m in args.modes.split(",") if m]:
            mode = resolve_mode(mode, ckpt.config.family, torch.device("cpu"), dtype)
            print(f"\nverify rounds, mode {mode}, {args.verify_context} tokens of context a lane, "
                  f"drafts kept with chance {args.verify_accept}:\n")
            print(verify_cost_table(ckpt, mode, dtype, lane_counts, args.verify_context, args.draft_max,
                                    args.verify_accept, repeat=max(args.repeat, 5)))
        return
    rows = []
    workloads = [(name, WORKLOADS[name]) for name in args.workloads.split(",")]
    samplings = [(name, bench_sampling(name, ckpt.path)) for name in args.sampling.split(",") if name]
    if args.model == "default" and not args.no_llama_cpp:
        for s_name, sampling in samplings:
            for name, workload in workloads:
                plain, lookup = llama_cpp_rates(str(default_model_path()), tok, workload, turns, max_tokens,
                                                args.draft_max, sampling)
                rows.append([f"{name} llama.cpp", s_name, 1, fmt_rate(plain), fmt_rate(lookup),
                             fmt_ratio(lookup, plain), "-", "-", "-", "-", "-", "-"])
                print("measured:", rows[-1], flush=True)
    for mode in [m for m in args.modes.split(",") if m]:
        mode = resolve_mode(mode, ckpt.config.family, torch.device("cpu"), dtype)
        runners = [ModelRunner(ckpt, device=torch.device("cpu"), dtype=dtype, num_lanes=max(lane_counts),
                               num_pages=max(lane_counts) * 96, page_size=16, mode=mode, draft_head=head)
                   for head in ((False, True) if args.drafter == "mtp" else (False,))]
        for s_name, sampling in samplings:
            for name, workload in workloads:
                for lanes in lane_counts:
                    row = measure(runners[0], runners[-1], args.drafter, tok, workload, lanes, turns, max_tokens,
                                  args.draft_max, f"{name} {mode}", args.repeat, sampling)
                    rows.append([row[0], s_name, *row[1:]])
                    print("measured:", rows[-1], flush=True)
        del runners
    print(markdown_table(["workload", "sampling", "lanes", "undrafted tok/s", "drafted tok/s", "ratio", "busy: undrafted",
                          "busy: drafted", "busy: ratio", "acceptance", "accepted per verify", "ids equal"], rows))


def measure(plain, drafting, drafter: str, tok, workload, lanes: int, turns: int, max_tokens: int, draft_max: int,
            label: str, repeat: int = 1, sampling: dict | None = None) -> list:
    """One table row: the workload's turns undrafted on `plain`, then drafted with `drafter` on
    `drafting` (the same runner for ngram), `repeat` times alternating; the median rates of each
    (a busy machine slows runs unevenly), over the batches and over their busy spans."""
    runs = {"off": [], "on": []}  # (batch rate, busy rate) per run
    for _ in range(repeat):
        off_ids, _, base, base_busy, _ = run_turns(plain, tok, workload, lanes, turns, max_tokens, "off", draft_max,
                                                   sampling)
        on_ids, usage, drafted, drafted_busy, verifies = run_turns(drafting, tok, workload, lanes, turns, max_tokens,
                                                                   drafter, draft_max, sampling)
        runs["off"].append((base, base_busy))
        runs["on"].append((drafted, drafted_busy))
        if repeat > 1:
            print(f"  {label} {lanes} lanes: undrafted {base:.1f} (busy {base_busy:.1f}), "
                  f"drafted {drafted:.1f} (busy {drafted_busy:.1f}) tok/s", flush=True)
    (base, base_busy), (drafted, drafted_busy) = (
        tuple(statistics.median(r[i] for r in runs[key]) for i in (0, 1)) for key in ("off", "on"))
    drafted_n = sum(u.draft_tokens for u in usage.values())
    accepted_n = sum(u.accepted_tokens for u in usage.values())
    return [label, lanes, fmt_rate(base), fmt_rate(drafted), fmt_ratio(drafted, base),
            fmt_rate(base_busy), fmt_rate(drafted_busy), fmt_ratio(drafted_busy, base_busy),
            f"{accepted_n / drafted_n:.2f}" if drafted_n else "-",
            f"{accepted_n / verifies:.2f}" if verifies else "-",
            "yes" if off_ids == on_ids else "NO"]


def bench_sampling(name: str, model_path: Path) -> dict | None:
    """`greedy`: None; `defaults`: the sampling `prefixd chat` picks for the model with no flags
    (the model's shipped settings over CHAT_DEFAULTS), without its per-request random seed."""
    if name == "greedy":
        return None
    if name != "defaults":
        raise SystemExit(f"--sampling: expected greedy or defaults, got {name!r}")
    from prefixd.daemon.client_cli import CHAT_DEFAULTS, _SAMPLING_KEYS
    from prefixd.engine.sampling_defaults import sampling_defaults

    source = "gguf" if Path(model_path).suffix == ".gguf" else "hf"
    shipped = {k: v for k, v in sampling_defaults(Path(model_path), source).items() if k in _SAMPLING_KEYS}
    chosen = {**CHAT_DEFAULTS, **shipped}
    return {k: chosen[k] for k in _SAMPLING_KEYS if k in chosen}


def verify_cost_table(ckpt, mode: str, dtype, lane_counts, context: int, draft_max: int, accept: float,
                      repeat: int) -> str:
    """Median round time with every lane verifying k drafts (copies of its last token: the
    rows cost the same whatever their tokens), k = 0..draft_max, and the rate bound it gives."""
    from bench.runtime import RunnerMeasure, Sizes, prompt_tokens
    from prefixd.scheduler.records import LaneWork, RoundPlan

    table = []
    for lanes in lane_counts:
        sizes = Sizes(prefill=(context,), decode_context=context, lanes=lanes, lane_context=context,
                      decode_steps=draft_max + 1, repeats=1)
        own = dataclasses.replace(ckpt, tensors=dict(ckpt.tensors))  # the model takes the tensors it uses
        m = RunnerMeasure(own, device=torch.device("cpu"), dtype=dtype, mode=mode, sizes=sizes, grid=256)
        m.start_decode({lane: prompt_tokens(context, ckpt.tokenizer.vocab_size, seed=100 + lane)
                        for lane in range(lanes)})

        def verify_round(k: int) -> float:
            work = tuple(LaneWork(lane, context, (m.first[lane],) * (1 + k), m._pages(lane, context + 1 + k), False,
                                  sample_rows=tuple(range(1 + k))) for lane in range(lanes))
            t0 = time.perf_counter()
            m.runner.run_round(RoundPlan(work))
            return time.perf_counter() - t0

        times: dict[int, list[float]] = {k: [] for k in range(draft_max + 1)}
        for _ in range(repeat):  # the draft lengths interleaved, so a slow spell spreads over all
            for k in times:
                times[k] += [verify_round(k) for _ in range(4)]
        base = statistics.median(times[0])
        for k, ts in times.items():
            t = statistics.median(ts)
            tokens = sum(accept ** j for j in range(k + 1))
            table.append([lanes, k, lanes * (1 + k), f"{t * 1e3:.1f}", fmt_ratio(t, base), f"{lanes * tokens:.1f}",
                          fmt_ratio(lanes * tokens / t, lanes / base)])
        del m
    return markdown_table(["lanes", "drafts a lane", "rows", "round ms", "vs no drafts", "tokens a round",
                           "rate vs undrafted"], table)


def tiny_mtp_dir() -> Path:
    """`--model tiny-mtp`: a random-weight qwen3_5 with one MTP layer and the default model's
    tokenizer and chat template (vocabulary of the tokenizer's size), in a temporary directory."""
    import shutil
    import tempfile

    from prefixd.gpu.families.qwen3_5_tiny import make_tiny_hybrid_dir
    from tests.helpers.tiny_models import _tokenizer_config, _tokenizer_files

    src = Path(_tokenizer_files())
    vocab = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
    path = make_tiny_hybrid_dir(Path(tempfile.mkdtemp(prefix="prefixd-tiny-mtp-")), seed=0, mtp_layers=1,
                                vocab_size=len(vocab), initializer_range=0.1)
    shutil.copyfile(src / "tokenizer.json", path / "tokenizer.json")
    config = _tokenizer_config((src / "chat_template.txt").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


if __name__ == "__main__":
    main()
