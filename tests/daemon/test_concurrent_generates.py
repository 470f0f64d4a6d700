"""Several generates sent together on one connection are admitted in the same round."""

from __future__ import annotations

import anyio

from prefixd.ipc.client import AsyncClient
from tests.daemon.fakes import LetterDevice
from tests.daemon.harness import running_server, wait_idle


class RecordingDevice(LetterDevice):
    """Records, per round, the lanes that prefill in it."""

    def __init__(self) -> None:
        super().__init__()
        self.prefill_lanes: list[list[int]] = []

    def run_round(self, plan):
        self.prefill_lanes.append([w.lane for w in plan.lanes if w.prefill])
        return super().run_round(plan)


async def test_generates_sent_together_on_one_connection_start_in_one_round(tmp_path):
    device = RecordingDevice()
    async with running_server(tmp_path, device) as server:
        async with await AsyncClient.connect(server.socket_path) as a, \
                await AsyncClient.connect(server.socket_path) as b:
            device.gate.clear()
            async with a.generate(prompt="hold", max_tokens=2) as held:
                while not device.waiting:  # the engine thread is parked inside a round
                    await anyio.sleep(0.01)
                streams = [await b.generate(prompt=f"p{k}", max_tokens=2).start() for k in range(3)]
                with anyio.fail_after(30):  # one at a time, the second would wait for the parked round
                    while len(server.link._sinks) < 4:  # noqa: SLF001 - all three reached the engine host
                        await anyio.sleep(0.01)
                num_before = len(device.prefill_lanes)
                device.gate.set()
                results = [await s.collect() for s in streams]
                await held.collect()
        assert [r.finish_reason for r in results] == ["length"] * 3
        first_after = next(lanes for lanes in device.prefill_lanes[num_before:] if lanes)
        assert sorted(first_after) == [1, 2, 3]
        await wait_idle(server)
