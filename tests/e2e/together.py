"""Run generates at once, each on its own connection, while watching the daemon's lanes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Hashable, Mapping

import anyio

from prefixd.ipc.client import AsyncClient, GenerateResult


async def run_together(socket: Path, requests: Mapping[Hashable, Mapping[str, Any]]) -> tuple[dict[Hashable, GenerateResult], int]:
    """Send every request at once, one connection each; return the results and the most
    lanes `status` saw busy at the same time while they ran (a check that they overlapped)."""
    results: dict[Hashable, GenerateResult] = {}
    most_busy = 0
    finished = anyio.Event()

    async def one(key: Hashable, fields: Mapping[str, Any]) -> None:
        async with await AsyncClient.connect(socket) as client:
            results[key] = await client.generate(**fields).collect()

    async def watch() -> None:
        nonlocal most_busy
        async with await AsyncClient.connect(socket) as client:
            while not finished.is_set():
                most_busy = max(most_busy, (await client.status())["lanes_busy"])

    async with anyio.create_task_group() as outer:
        outer.start_soon(watch)
        async with anyio.create_task_group() as tg:
            for key, fields in requests.items():
                tg.start_soon(one, key, fields)
        finished.set()
    return results, most_busy
