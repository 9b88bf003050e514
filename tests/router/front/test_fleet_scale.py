"""One router takes 1,000 workers through ``POST /v1/workers`` and ingests their events.

The workers are real: one ZeroMQ PUB socket and one HTTP port each, in a helper process
(:mod:`tests.support.fleet`); the router is the ``kvroute router`` command. A sample of
the workers (every 50th and the last registered) publishes, and the index must hold each
one's blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from events.identity import WorkerId
from router.cluster.runner import ProcessGroup, wait_healthy
from router.index.redis_index import RedisPrefixIndex
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.store.server import free_port
from tests.support.faults import python_m
from tests.support.fleet import BLOCKS, Fleet
from tests.support.ingest import KEYER, keys
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

NUM_WORKERS = 1000
BOUND_S = 120.0


async def _register(url: str, bodies: list[dict[str, object]]) -> list[int]:
    """POST every body (a few at a time); the statuses in order."""
    slots = asyncio.Semaphore(8)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(body: dict[str, object]) -> int:
            async with slots, session.post(f"{url}/v1/workers", json=body) as resp:
                await resp.read()
                return resp.status

        return await asyncio.gather(*(one(b) for b in bodies))


def test_one_router_registers_and_ingests_1000_workers(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    sample = [*range(0, NUM_WORKERS, 50), NUM_WORKERS - 1]
    prompts = {i: 10_000 + i for i in sample}  # a family of its own per sampled worker
    group = ProcessGroup(tmp_path, stop_timeout_s=10.0)

    async def scenario(fleet: Fleet, url: str) -> None:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, group, time.monotonic() + BOUND_S)
        statuses = await _register(url, fleet.bodies)
        assert Counter(statuses) == {201: NUM_WORKERS}
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/workers") as r:
            assert len((await r.json())["workers"]) == NUM_WORKERS
        client = await connect(redis_url)
        try:
            index = RedisPrefixIndex(client, KeyLayout(namespace), KEYER)
            for i in sample:
                worker = WorkerId(f"f{i}")

                async def ingested(i: int = i, worker: WorkerId = worker) -> bool:
                    found = dict(await index.lookup(keys(prompts[i])))
                    if worker in found:
                        assert set(found) == {worker}
                        return found[worker].num_blocks == BLOCKS
                    fleet.publish(i, prompts[i])  # until its subscription has joined
                    return False

                await eventually(ingested, what=f"{worker}'s blocks", timeout_s=BOUND_S)
        finally:
            await client.aclose()

    with Fleet(NUM_WORKERS) as fleet:
        port = free_port()  # after the fleet took its 2,000 ports
        try:
            group.start(
                "router",
                python_m(
                    "router", "--redis", redis_url, "--namespace", namespace,
                    "--port", str(port), "--log-level", "WARNING",
                ),
            )  # fmt: skip
            asyncio.run(scenario(fleet, f"http://127.0.0.1:{port}"))
        finally:
            group.stop()
