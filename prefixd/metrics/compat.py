"""Router-facing metric names: a worker's load and prefix-cache counters as vLLM names them.

The Gateway API inference extension's endpoint picker (llm-d's scheduler) scrapes these names
from a worker's `/metrics` by default, and SMG reads the same gauges from a worker it takes
for vLLM. prefixd serves them on its HTTP port's `/metrics` (front/http/worker.py), beside
its own names, never on `--metrics-addr`: a prefixd dashboard sees only prefixd's names.

Nothing here is counted twice. The gauges are one `WorkerLoad` (the engine's status of this
moment, the same one `/v1/loads` answers); the counters are prefixd's own
`prefixd_prefix_cache_{queries,hits}_tokens_total`, read from the daemon's registry.

    vllm:num_requests_running    gauge    streams on a lane
    vllm:num_requests_waiting    gauge    streams waiting for a lane, in the engine or at the gate
    vllm:kv_cache_usage_perc     gauge    KV pages busy lanes hold / all pages (0..1)
    vllm:gpu_cache_usage_perc    gauge    the same value under vLLM v0's name (older pickers)
    vllm:prefix_cache_queries    counter  prompt tokens looked up in the prefix cache
    vllm:prefix_cache_hits       counter  prompt tokens served from it (or a resident lane)
    vllm:cache_config_info       gauge 1  labels block_size (the page size), num_gpu_blocks
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

QUERIES_SAMPLE = "prefixd_prefix_cache_queries_tokens_total"
HITS_SAMPLE = "prefixd_prefix_cache_hits_tokens_total"


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One daemon's load as a router weighs it, from one engine status map."""

    num_running: int  # streams holding a lane
    num_waiting: int  # streams the engine holds without a lane, plus generates waiting for a seat
    num_pages: int  # the KV pool
    num_pages_busy: int  # pages held by busy lanes (pages only the prefix cache or a resident lane holds are not)
    page_size: int  # tokens per page
    num_lanes: int

    @property
    def token_usage(self) -> float:
        """Busy lanes' share of the KV pool, 0..1; pages two lanes share count for each."""
        return min(1.0, self.num_pages_busy / self.num_pages) if self.num_pages else 0.0

    @classmethod
    def from_status(cls, status: Mapping[str, Any], *, seats_waiting: int) -> WorkerLoad:
        """From the daemon's status map (front/connection.Services.status) and the gate's seat queue."""
        busy_pages = sum(lane["pages"] for lane in status["lanes"] if lane["state"] == "busy")
        return cls(num_running=int(status["lanes_busy"]), num_waiting=int(status["waiting"]) + seats_waiting,
                   num_pages=int(status["pages_free"]) + int(status["pages_used"]), num_pages_busy=busy_pages,
                   page_size=int(status["page_size"]), num_lanes=len(status["lanes"]))


class _Families:
    """What generate_latest needs of a registry: `collect()`."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self.families)


def vllm_families(load: WorkerLoad, registry: CollectorRegistry | None, model: str) -> list[Metric]:
    """The vLLM-named families for `load` and, when `registry` is the daemon's, its cache counters."""
    labels, values = ["model_name"], [model]
    out: list[Metric] = []
    for name, doc, value in (
        ("vllm:num_requests_running", "Requests on a lane (prefixd_lanes_busy).", load.num_running),
        ("vllm:num_requests_waiting", "Requests waiting for a lane, in the engine or at the gate.", load.num_waiting),
        ("vllm:kv_cache_usage_perc", "KV pages held by running requests, 1 is all of them.", load.token_usage),
        ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc under vLLM v0's name.", load.token_usage),
    ):
        family = GaugeMetricFamily(name, doc, labels=labels)
        family.add_metric(values, float(value))
        out.append(family)
    if registry is not None:
        for name, doc, sample in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", QUERIES_SAMPLE),
            ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache or a resident lane.", HITS_SAMPLE),
        ):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, registry.get_sample_value(sample) or 0.0)
            out.append(family)
    info = GaugeMetricFamily("vllm:cache_config_info", "KV cache layout: page size and pages.",
                             labels=["model_name", "block_size", "num_gpu_blocks"])
    info.add_metric([model, str(load.page_size), str(load.num_pages)], 1.0)
    out.append(info)
    return out


def render(load: WorkerLoad, registry: CollectorRegistry | None, model: str) -> bytes:
    """Prometheus text: the daemon's own registry (when given), then the vLLM-named families."""
    own = generate_latest(registry) if registry is not None else b""
    return own + generate_latest(_Families(vllm_families(load, registry, model)))  # type: ignore[arg-type]
