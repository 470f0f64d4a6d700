"""Scale-out benchmark: an agent workload through SMG over several prefixd daemons.

    python bench/scale.py                       # the full table (the default model; run it idle)
    python bench/scale.py --quick               # a smoke run: tiny random llama, small sizes
    python bench/scale.py --daemons 4           # four daemons behind the router instead of two
    python bench/scale.py --cache-threshold 0.8 # adds a cache_aware row with SMG's --cache-threshold 0.8
    python bench/scale.py --shared-cache redis://127.0.0.1:6379   # adds the rows with the shared tier

Needs `smg` on PATH (`pip install smg`). Each row starts fresh daemons (`prefixd serve --http`,
the same lanes, context and cache budget each) and runs the same workload: several agent
conversations at once, each 10+ turns, every turn resending the whole conversation (a shared
system prompt with tool rules, the task, then the assistant's replies and tool results). Rows:

- one daemon alone, no router (the reference);
- SMG `cache_aware` over N daemons, then SMG `round_robin` over N daemons;
- SMG `manual` over N daemons, each conversation sending its own `x-smg-routing-key` (a new
  key goes to the daemon holding the fewest keys, then stays there);
- with --shared-cache URL, both again with every daemon on that shared tier.

It prints, per row, the share of prompt tokens served from cache (`cached_tokens` over
`prompt_tokens`, summed over every turn), that share against the daemon alone, how the
requests split over the daemons, the median turn time and the wall time. Each row uses its
own cache namespace, so a shared tier never carries one row's entries into the next.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from contextlib import ExitStack, contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, Iterator, Sequence  # noqa: E402

import httpx  # noqa: E402

from bench.common import fmt_ratio, markdown_table, median, print_machine  # noqa: E402
from bench.daemon import stop_process  # noqa: E402

READY_S = 600.0  # bounds on waiting for a process to come up
SYSTEM = ("You are a coding agent working in a repository. Tools: read_file(path), run(cmd), edit(path, old, new). "
          "Think briefly, then call one tool per turn. Rules: never run destructive commands; read a file "
          "before you edit it; keep edits small; report what you changed and why in one sentence at the end.")
TASKS = ["fix the failing date parser test", "add a --verbose flag to the CLI", "speed up the CSV loader",
         "remove the unused cache module", "document the retry policy", "make the config loader strict",
         "port the shell script to Python", "find why the build is slow"]
WORDS = "the of and to in is that for it as with was on be by this are from at or an file line test".split()


@dataclass(frozen=True)
class Sizes:
    conversations: int  # agent conversations in flight at once
    turns: int  # turns of each
    max_tokens: int  # tokens each reply generates
    tool_words: int  # words of each tool result
    lanes: int  # per daemon
    max_context: int
    cache_budget: str


FULL = Sizes(conversations=8, turns=12, max_tokens=48, tool_words=120, lanes=4, max_context=8192, cache_budget="2G")
QUICK = Sizes(conversations=3, turns=10, max_tokens=4, tool_words=20, lanes=2, max_context=2048, cache_budget="64M")


@dataclass
class Row:
    name: str
    prompt_tokens: int
    cached_tokens: int
    split: list[int]  # requests each daemon served
    turn_s: list[float]
    wall_s: float

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool_result(rng: random.Random, words: int) -> str:
    return "Tool output:\n" + " ".join(rng.choice(WORDS) for _ in range(words))


# -- processes -------------------------------------------------------------------------------


@contextmanager
def http_daemon(model: str, sizes: Sizes, extra: Sequence[str], tmp: Path) -> Iterator[str]:
    """`prefixd serve --http` on a free loopback port; yields its base URL once /health is 200."""
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "prefixd.daemon.cli", "serve", "--model", model, "--socket", str(tmp / "sock"),
           "--metrics-addr", "", "--disk-cache", str(tmp / "disk"), "--http", f"127.0.0.1:{port}",
           "--lanes", str(sizes.lanes), "--max-context", str(sizes.max_context),
           "--cache-budget", sizes.cache_budget, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(tmp / "daemon.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: status_of(f"{base}/health") == 200, proc, tmp / "daemon.log")
        yield base
    finally:
        stop_process(proc)


@contextmanager
def smg(worker_urls: list[str], policy: str, tmp: Path, extra: Sequence[str] = ()) -> Iterator[str]:
    """`smg launch` on loopback; yields its base URL once every worker is ready. The warm-up
    slice is off (it sends hits to an empty worker on purpose), as docs/scale.md advises."""
    port = free_port()
    cmd = ["smg", "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
           "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0", "--log-level", "warn", *extra]
    with open(tmp / f"smg-{policy}.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: workers_ready(base, len(worker_urls)), proc, tmp / f"smg-{policy}.log")
        yield base
    finally:
        stop_process(proc)


def wait_until(ready: Any, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[0]} did not come up:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status
    except OSError:
        return 0


def workers_ready(base: str, count: int) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/workers", timeout=5) as reply:
            workers = json.loads(reply.read())["workers"]
    except (OSError, ValueError):
        return False
    return len(workers) == count and all(w.get("is_healthy") and w.get("status") == "ready" for w in workers)


def num_requests(base: str) -> int:
    """Requests the daemon at `base` finished (its /metrics, prefixd_requests_total summed)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    return int(sum(float(line.rpartition(" ")[2]) for line in lines if line.startswith("prefixd_requests_total{")))


def served_name(base: str) -> str:
    """The model's name as /v1/models gives it (SMG routes a request by it)."""
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as reply:
        return json.loads(reply.read())["data"][0]["id"]


# -- the workload ----------------------------------------------------------------------------


async def conversation(client: httpx.AsyncClient, base: str, index: int, sizes: Sizes, namespace: str,
                       model: str, keyed: bool) -> tuple[int, int, list[float]]:
    """One agent conversation of `sizes.turns` turns; (prompt tokens, cached tokens, turn times).
    `keyed`: every turn carries the conversation's SMG routing key (x-smg-routing-key)."""
    headers = {"x-smg-routing-key": f"{namespace}-conversation-{index}"} if keyed else {}
    rng = random.Random(index)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {index}: {TASKS[index % len(TASKS)]}."}]
    prompt = cached = 0
    times: list[float] = []
    for _ in range(sizes.turns):
        # the namespace rides in `user`: SMG forwards only a few headers, not x-prefixd-namespace
        body = {"model": model, "messages": messages, "max_tokens": sizes.max_tokens, "temperature": 0,
                "user": namespace}
        t0 = time.perf_counter()
        reply = await client.post(f"{base}/v1/chat/completions", json=body, headers=headers)
        times.append(time.perf_counter() - t0)
        reply.raise_for_status()
        data = reply.json()
        prompt += data["usage"]["prompt_tokens"]
        cached += data["usage"]["prompt_tokens_details"]["cached_tokens"]
        messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": tool_result(rng, sizes.tool_words)})
    return prompt, cached, times


async def workload(base: str, sizes: Sizes, namespace: str, model: str,
                   keyed: bool) -> tuple[int, int, list[float], float]:
    async with httpx.AsyncClient(timeout=None) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(conversation(client, base, i, sizes, namespace, model, keyed)
                                         for i in range(sizes.conversations)))
        wall = time.perf_counter() - t0
    return (sum(r[0] for r in results), sum(r[1] for r in results), [t for r in results for t in r[2]], wall)


def run_row(name: str, model: str, sizes: Sizes, daemons: int, policy: str | None,
            flags: Sequence[str], tmp: Path, router_flags: Sequence[str] = ()) -> Row:
    """Fresh daemons (and SMG over them unless `policy` is None), then the workload once."""
    with ExitStack() as stack:
        urls = [stack.enter_context(http_daemon(model, sizes, flags, tmp / f"{name}-{i}")) for i in range(daemons)]
        base = urls[0] if policy is None else stack.enter_context(smg(urls, policy, tmp, router_flags))
        before = [num_requests(u) for u in urls]
        keyed = policy == "manual"
        prompt, cached, times, wall = asyncio.run(workload(base, sizes, f"bench-{name}", served_name(urls[0]), keyed))
        split = [num_requests(u) - b for u, b in zip(urls, before)]
    return Row(name, prompt, cached, split, times, wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny random llama, small sizes (a smoke run)")
    ap.add_argument("--model", default=None, help="model to serve (default: prefixd's default; --quick: tiny llama)")
    ap.add_argument("--daemons", type=int, default=2, help="daemons behind the router (default 2)")
    ap.add_argument("--cache-threshold", default="", help="adds a cache_aware row with this SMG --cache-threshold")
    ap.add_argument("--shared-cache", default="", help="a shared tier URL: adds the rows with it on every daemon")
    args = ap.parse_args()
    if shutil.which("smg") is None:
        sys.exit("bench/scale.py needs smg on PATH: pip install smg")
    sizes = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="prefixd-scale-") as tmp_name:
        tmp = Path(tmp_name)
        model, flags = args.model or "default", []
        if args.quick and args.model is None:
            from tests.helpers.tiny_models import make_tiny_hf_dir

            model, flags = str(make_tiny_hf_dir(tmp / "llama", "llama", seed=3)), ["--dtype", "fp32"]
        n = args.daemons
        plan: list[tuple[str, int, str | None, list[str], list[str]]] = [
            ("alone", 1, None, flags, []),
            (f"cache_aware x{n}", n, "cache_aware", flags, []),
            (f"round_robin x{n}", n, "round_robin", flags, []),
            (f"manual x{n}, key per conversation", n, "manual", flags, ["--assignment-mode", "min_group"]),
        ]
        if args.cache_threshold:
            plan.append((f"cache_aware x{n} threshold {args.cache_threshold}", n, "cache_aware", flags,
                         ["--cache-threshold", args.cache_threshold]))
        if args.shared_cache:
            shared = [*flags, "--shared-cache", args.shared_cache]
            plan += [(f"cache_aware x{n} + shared", n, "cache_aware", shared, []),
                     (f"round_robin x{n} + shared", n, "round_robin", shared, [])]
        print_machine({"sizes": str(sizes), "model": model})
        rows = [run_row(name.replace(" ", "_"), model, sizes, count, policy, row_flags, tmp, router_flags)
                for name, count, policy, row_flags, router_flags in plan]
    alone = rows[0].cached_share
    print(markdown_table(
        ["setup", "prompt tokens", "cached tokens", "cached share", "vs alone", "requests per daemon",
         "median turn s", "wall s"],
        [[r.name.replace("_", " "), r.prompt_tokens, r.cached_tokens, f"{r.cached_share:.3f}",
          fmt_ratio(r.cached_share, alone), " / ".join(map(str, r.split)), f"{median(r.turn_s):.3f}",
          f"{r.wall_s:.1f}"] for r in rows]))


if __name__ == "__main__":
    main()
