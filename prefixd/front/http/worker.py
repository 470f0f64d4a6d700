"""The routes a router probes on a worker, beside /health and /v1/models (app.py).

SMG and vllm-router admit a worker on `GET /health` (200), name it from `/v1/models`, read
its facts from `/get_server_info` and `/get_model_info` (SMG tries `/model_info` first), and
weigh it by its load: SMG's load-aware policies and overload guard poll `/v1/loads`, and
vllm-router's `power_of_two` polls `/get_load`. The Gateway API inference extension (llm-d)
scrapes `/metrics` on the serving port for vLLM's gauge names (metrics/compat.py).

    GET /v1/loads        {timestamp, dp_rank_count: 1, loads: [one rank's running, waiting, KV use]}
    GET /get_load        {load: running + waiting}
    GET /get_server_info the model, lanes, context, KV pool, version (kv_block_size with --kv-events)
    GET /model_info      the model (also /get_model_info)
    GET /metrics         prefixd's own metrics, then vLLM's names for the same numbers
    GET /kv_event_sources  with --kv-events: {"0": where rank 0 publishes (vLLM's KVEventsConfig)}
    POST /tokenize       vLLM's: a chat or completion body's prompt ids, as its generate would use them

Every load comes from one engine status of this moment (WorkerLoad), so `/v1/loads`,
`/get_load` and `/metrics` agree. prefixd leaves `/server_info` and `/version` unanswered:
SMG takes a worker answering them for SGLang or vLLM, and prefixd is neither; it registers
it as an OpenAI-compatible worker, which reads all of the above. Like `/health`, these routes
need no token: they carry counts and names, never a prompt or a reply (as vLLM leaves
`/metrics`, `/health` and `/load` open when it guards `/v1`).

vllm-router's `kv_aware` reads vLLM's discovery pair, `kv_block_size` in `/get_server_info`
and `/kv_event_sources`, when it admits a worker; both answer only while the engine publishes
(`--kv-events` and a store): otherwise the second is 404, which it takes for "no events"
(0.1.17 subscribes only to sources named on its command line: docs/scale.md). To score a
request it needs the prompt's ids: it asks a worker's `/tokenize` (after
`/v1/chat/completions/render`, which prefixd leaves 404) and hashes them in blocks as it
hashes the events' `token_ids`. `/tokenize` carries a prompt, so it needs the token as `/v1` does.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import prefixd
from prefixd.front.http.app import openai_namespace, read_mapped
from prefixd.front.http.openai_map import HttpError, map_chat, map_completion
from prefixd.metrics import MetricsObserver, compat
from prefixd.metrics.compat import WorkerLoad


@dataclass(frozen=True)
class KvEventSource:
    """Where the engine process publishes its KV events (`--kv-events`, engine/kv_events.py),
    as the daemon's config says; the front only reports it."""

    endpoint: str  # the PUB socket: tcp://HOST:PORT or ipc://PATH, without ?topic=
    topic: str  # the topic frame of every message ("" by default)
    replay_endpoint: str | None  # the ROUTER socket (--kv-events-replay), or None
    buffer_steps: int  # batches the replay ring holds
    hwm: int  # messages ZMQ queues per subscriber before it drops

    def to_wire(self) -> dict[str, Any]:
        """One data-parallel rank's entry of `/kv_event_sources`, in the fields of vLLM's
        KVEventsConfig (the shape vllm-router reads)."""
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, "topic": self.topic,
                "buffer_steps": self.buffer_steps, "hwm": self.hwm}


class WorkerApi:
    """Router probes over an HttpFront (app.py)."""

    def __init__(self, front: Any) -> None:
        self.front = front
        self.services = front.services
        self.gate = front.gate

    def routes(self) -> list[Route]:
        return [
            Route("/v1/loads", self.loads, methods=["GET"]),
            Route("/get_load", self.get_load, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/kv_event_sources", self.kv_event_sources, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
        ]

    # -- load -------------------------------------------------------------------------------

    async def load(self) -> WorkerLoad | None:
        """The daemon's load now; None while the engine does not serve (restarting, stopping)."""
        if not self.gate.link.serving or self.services.shutting_down():
            return None
        status = await self.services.status()
        seats = self.gate.seats
        return WorkerLoad.from_status(status, seats_waiting=seats.num_waiting if seats is not None else 0)

    async def loads(self, request: Request) -> Response:
        """SMG's load schema (one data-parallel rank); 503 while the engine does not serve."""
        load = await self.load()
        if load is None:
            return self._unavailable()
        rank = {
            "dp_rank": 0,
            "num_running_reqs": load.num_running,
            "num_waiting_reqs": load.num_waiting,
            "num_total_reqs": load.num_running + load.num_waiting,
            "num_used_tokens": load.num_pages_busy * load.page_size,
            "max_total_num_tokens": load.num_pages * load.page_size,
            "token_usage": load.token_usage,
            "max_running_requests": load.num_lanes,
            "cache_hit_rate": self._cache_hit_rate(),
        }
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        return JSONResponse({"timestamp": now, "dp_rank_count": 1, "loads": [rank]})

    async def get_load(self, request: Request) -> Response:
        """vllm-router's power_of_two: `{"load": N}`, the requests running and waiting."""
        load = await self.load()
        if load is None:
            return self._unavailable()
        return JSONResponse({"load": load.num_running + load.num_waiting})

    async def metrics(self, request: Request) -> Response:
        load = await self.load()
        if load is None:
            return self._unavailable()
        body = compat.render(load, self._registry(), self.front.model)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- facts ------------------------------------------------------------------------------

    async def server_info(self, request: Request) -> Response:
        """The facts SMG keeps as a worker's labels (its ServerInfo fields) and vllm-router's `dp_size`."""
        info = self.services.hello_reply()["model"]
        load = await self.load()
        body: dict[str, Any] = {
            "model": self.front.model,
            "model_path": self.front.model,
            "served_model_name": self.front.model,
            "version": f"prefixd {prefixd.__version__}",
            "context_length": info.get("max_context"),
            "max_running_requests": load.num_lanes if load is not None else info.get("lanes"),
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "is_embedding": False,
        }
        if load is not None:
            body["max_total_tokens"] = load.num_pages * load.page_size
            body["page_size"] = load.page_size
        if load is not None and await self._publishing():  # the announced blocks are the pool's pages
            body["kv_block_size"] = load.page_size
        return JSONResponse(body)

    async def kv_event_sources(self, request: Request) -> Response:
        """vLLM's discovery body, keyed by data-parallel rank (one: "0"); 404 when the engine
        publishes nothing (no --kv-events, or no prefix store to announce), 503 while it restarts."""
        source = self.front.kv_events
        if source is not None and (not self.gate.link.serving or self.services.shutting_down()):
            return self._unavailable()
        if source is None or not await self._publishing():
            return JSONResponse({"error": "this daemon publishes no KV events (--kv-events, and a prefix store)"},
                                status_code=404)
        return JSONResponse({"0": source.to_wire()})

    async def model_info(self, request: Request) -> Response:
        info = self.services.hello_reply()["model"]
        return JSONResponse({"model_path": self.front.model, "is_generation": True,
                             "model_type": info.get("family"), "has_image_understanding": False,
                             "has_audio_understanding": False})

    async def tokenize(self, request: Request) -> Response:
        return await self.front._guard(request, lambda: self._tokenize(request))

    async def _tokenize(self, request: Request) -> Response:
        """vLLM's `/tokenize`: `messages` (a chat body) or `prompt` (a completion's string)
        rendered and tokenized as /v1/chat/completions or /v1/completions would, nothing
        generated: `{count, max_model_len, tokens}`."""
        def parse(body: dict[str, Any]) -> tuple[str, Any]:
            self.front.check_model(body.get("model"))
            if body.get("continue_final_message") or body.get("add_generation_prompt") is False:
                raise HttpError(400, "continue_final_message and add_generation_prompt: false are not supported; "
                                "prefixd renders a chat prompt for a new reply", param="messages")
            namespace = openai_namespace(request, body)
            fields = {k: v for k, v in body.items() if k not in ("continue_final_message", "add_generation_prompt")}
            if "messages" in body:
                return namespace, map_chat(fields, namespace, self.front.normalisers)
            return namespace, map_completion(fields, namespace)

        namespace, mapped = await read_mapped(request, parse)
        built = await self.front.build_only(request, mapped, namespace)
        tokens = [int(t) for t in built.request.tokens]
        max_context = self.services.hello_reply()["model"].get("max_context")
        return JSONResponse({"count": len(tokens), "max_model_len": max_context, "tokens": tokens})

    # -- helpers ----------------------------------------------------------------------------

    async def _publishing(self) -> bool:
        """Whether the engine publishes KV events now: --kv-events and a store (its status says)."""
        if self.front.kv_events is None or not self.gate.link.serving or self.services.shutting_down():
            return False
        return "kv_events" in await self.services.status()

    def _registry(self) -> Any:
        """The daemon's metrics registry: the one the engine link's observer writes (None without one)."""
        observer = self.gate.link.observer
        return observer.metrics.registry if isinstance(observer, MetricsObserver) else None

    def _cache_hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens looked up, since the daemon started."""
        registry = self._registry()
        if registry is None:
            return 0.0
        queries = registry.get_sample_value(compat.QUERIES_SAMPLE) or 0.0
        hits = registry.get_sample_value(compat.HITS_SAMPLE) or 0.0
        return hits / queries if queries else 0.0

    def _unavailable(self) -> Response:
        state = "shutting_down" if self.services.shutting_down() else self.gate.link.state
        return JSONResponse({"status": state}, status_code=503)
