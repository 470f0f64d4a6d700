"""Issue 8 through the socket: non-finite image rows are refused at admission, and one that gets
past admission ends its own request alone; every other stream keeps its bits, then and after."""

from __future__ import annotations

import io
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import anyio
import numpy as np
import pytest

from prefixd.daemon.config import DaemonConfig
from prefixd.front.requests import RequestBuilder
from prefixd.daemon.server import Server
from prefixd.gpu import cpu_kernels
from prefixd.ipc.client import AsyncClient
from prefixd.ipc.errors import ClientError
from prefixd.ipc.parts import Image
from prefixd.scheduler.records import ImageIdentity, ImageRows
from tests.daemon.harness import running_server, wait_idle
from tests.helpers.tiny_models import make_tiny_hf_dir

HIDDEN = 64  # the tiny llama's


def image(values: np.ndarray, at: int = 2) -> Image:
    return Image(at=at, tokens=values.shape[0], gh=1, gw=values.shape[0], hash=b"picture",
                 rows=np.ascontiguousarray(values, dtype="<f4").tobytes())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
async def test_non_finite_image_rows_are_bad_payload(tmp_path, bad):
    rows = np.zeros((3, 4), dtype=np.float32)  # the fake model's hidden size is 4
    rows[1, 2] = bad
    async with running_server(tmp_path) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            with pytest.raises(ClientError) as err:
                await client.generate(tokens=[5, 6, 7, 8, 9], max_tokens=2, images=[image(rows)]).collect()
            assert err.value.code == "bad_payload"
            assert err.value.message == (f"images.rows: value {np.float32(bad)} at row 1, column 2 of the image at 2 "
                                         "is not finite; embeddings must be finite float32")
            result = await client.generate(tokens=[5, 6, 7, 8, 9], max_tokens=2,
                                           images=[image(np.zeros((3, 4)))]).collect()
            assert result.finish_reason == "length"
        status = await wait_idle(server)
        assert status["lanes_busy"] == 0 and status["waiting"] == 0


# -- a real model behind the socket ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_iso") / "model", "llama", seed=3)


@asynccontextmanager
async def tiny_server(tmp_path: Path, model: Path, *, dtype: str = "fp32", mode: str = "auto",
                      cuda_graphs: str = "auto", overlap: str = "auto") -> AsyncIterator[Server]:
    cfg = DaemonConfig(model=str(model), dtype=dtype, mode=mode, lanes=8, max_context=512, cache_budget_bytes=32 << 20,
                       socket_path=tmp_path / "run" / "prefixd.sock", metrics_addr="127.0.0.1:0",
                       cuda_graphs=cuda_graphs, overlap=overlap)
    server = Server(cfg, env={}, out=io.StringIO())
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run)
        await server.listening.wait()
        try:
            yield server
        finally:
            server.request_exit(0)


def unchecked_image(self: RequestBuilder, image, request_id: int) -> ImageRows:
    """`RequestBuilder._image` without its finiteness check: an attack that gets past admission."""
    rows = np.frombuffer(image.rows, dtype="<f4").reshape(image.tokens, HIDDEN)
    return ImageRows(ImageIdentity(image.at, image.tokens, image.gh, image.gw, image.hash), rows)


HONEST = [list(range(1000 + 37 * i, 1000 + 37 * i + 20 + i)) for i in range(12)]


async def honest(client: AsyncClient, tokens: list[int]) -> tuple:
    r = await client.generate(tokens=tokens, max_tokens=6, logits=True, cache=False).collect()
    return r.ids, r.logits_sha256, r.finish_reason


async def run_together(server: Server, attack: bool) -> tuple[tuple, object]:
    """One honest stream beside (or without) a NaN-image attack from another connection."""
    out: dict = {}
    async with await AsyncClient.connect(server.socket_path) as a, await AsyncClient.connect(server.socket_path) as b:
        async def attacker() -> None:
            rows = np.full((8, HIDDEN), np.nan, dtype=np.float32)
            out["attack"] = await b.generate(tokens=list(range(300, 340)), max_tokens=6,
                                             images=[image(rows, at=4)]).collect()

        async def victim() -> None:
            out["honest"] = await honest(a, list(range(500, 560)))

        async with anyio.create_task_group() as tg:
            if attack:
                tg.start_soon(attacker)
            tg.start_soon(victim)
    return out["honest"], out.get("attack")


async def twelve(server: Server) -> list[tuple]:
    results: list = [None] * len(HONEST)
    async with await AsyncClient.connect(server.socket_path) as client:
        async def one(i: int) -> None:
            results[i] = await honest(client, HONEST[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(HONEST)):
                tg.start_soon(one, i)
    return results


# int4: its own kernels read the pool in place, and the attack's NaN pages are reused;
# "eager" graphs: decode rounds run as the fixed programs CUDA captures (gpu/programs.py), whose
# attention reads every block up to its bucket's context, the reused NaN pages included; with
# them, overlap on (CUDA's defaults): each round runs on the device thread beside the next's admission
NUMERICS = [("fp32", "invariant", "auto", "auto"), ("fp32", "invariant", "eager", "on"), pytest.param(
    "bf16", "int4", "auto", "auto", marks=pytest.mark.skipif(not cpu_kernels.available()[0],
                                                      reason="mode int4's CPU kernels cannot be built here"))]


@pytest.mark.parametrize(("dtype", "mode", "graphs", "overlap"), NUMERICS)
async def test_a_nan_image_past_admission_ends_only_its_own_request(tmp_path, tiny_dir, monkeypatch, dtype, mode,
                                                                   graphs, overlap):
    monkeypatch.setattr(RequestBuilder, "_image", unchecked_image)
    async with tiny_server(tmp_path, tiny_dir, dtype=dtype, mode=mode, cuda_graphs=graphs, overlap=overlap) as server:
        assert server.model_info["mode"] == mode  # the numerics under test
        clean, _ = await run_together(server, attack=False)
        before = await twelve(server)
        got, attack = await run_together(server, attack=True)
        assert attack.finish_reason == "error" and attack.ids == ()
        assert attack.note == ("this request failed in its lane round: the logits row at position 39 "
                               "is not finite (NaN or inf)")
        assert got == clean and clean[2] == "length" and len(clean[1]) == 6
        after = await twelve(server)  # the attack's NaN pages are reused by these
        assert after == before and {r[2] for r in after} == {"length"}
        status = await wait_idle(server)  # and the engine's integrity checks pass
        assert status["lanes_busy"] == 0 and status["waiting"] == 0
        assert status["failed_rounds"] == 0  # no round failed as a whole
        assert bool(status["decode_programs"]) == (graphs == "eager")


async def test_sampling_edges_the_spec_allows_finish_on_a_real_model(tmp_path, tiny_dir):
    prompt = list(range(700, 730))
    async with tiny_server(tmp_path, tiny_dir) as server:
        async with await AsyncClient.connect(server.socket_path) as client:
            async def run(**sampling):
                return await client.generate(tokens=prompt, max_tokens=5, cache=False, sampling=sampling).collect()

            greedy = await run()
            tiny = await run(temperature=1e-38, seed=1)
            assert (tiny.ids, tiny.finish_reason) == (greedy.ids, "length")  # an argmax over the top logits
            for sampling in ({"temperature": 1e308, "seed": 2}, {"temperature": 5e-324, "seed": 3},
                             {"temperature": 0.7, "repetition_penalty": 1e-300, "seed": 4},
                             {"temperature": 0.7, "repetition_penalty": 1e300, "seed": 5},
                             {"temperature": 1.0, "top_k": 2**31 - 1, "min_p": 1.0, "top_p": 1e-300, "seed": 6}):
                result = await run(**sampling)
                assert (result.finish_reason, len(result.ids)) == ("length", 5), sampling
        assert (await wait_idle(server))["lanes_busy"] == 0
