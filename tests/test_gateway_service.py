"""`GatewayService`'s frame loops against stand-in sockets and core: what the event loop owes other work."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.gateway.service import GatewayService
from shared import protocol as p


class BacklogSocket:
    """A ROUTER with `frames` already received: each receive completes without yielding, as pyzmq's does on a
    readable socket; past the backlog it waits forever."""

    def __init__(self, frames: list[list[bytes]]):
        self.frames = list(reversed(frames))

    async def recv_multipart(self) -> list[bytes]:
        if not self.frames:
            await asyncio.Event().wait()
        return self.frames.pop()


class CountingCore:
    """Counts the client messages handed to it; answers none."""

    def __init__(self):
        self.handled = 0

    def on_client(self, identity, msg, now):
        self.handled += 1
        return []

    def client_error(self, identity, exc, request_id):
        return []


def test_a_backlog_of_client_frames_lets_other_work_run_between_frames():
    """A flood of `health` frames from one connection (300k stalled the loop ~9.6 s) must not hold the event loop
    until it is drained: the engines' token relay, heartbeats and ticks run between two frames."""
    n = 1000

    async def scenario() -> int:
        core = CountingCore()
        service = GatewayService(core, addresses=None)
        service.res = SimpleNamespace(client=BacklogSocket([[b"c", p.encode(p.Health(id=str(i)))] for i in range(n)]))
        seen = []

        async def other_work():
            seen.append(core.handled)

        loop_task = asyncio.create_task(service._client_loop())
        await asyncio.create_task(other_work())
        while core.handled < n:  # the backlog still drains, every frame handled
            await asyncio.sleep(0)
        loop_task.cancel()
        return seen[0]

    handled_before_other_work = asyncio.run(scenario())
    assert handled_before_other_work < n  # 1 with a yield after each frame; n when the loop held on
