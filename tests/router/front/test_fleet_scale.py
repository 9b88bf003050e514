"""One router takes 1,000 workers through ``POST /v1/workers`` and ingests their events;
past what its file descriptors allow, it refuses a worker cleanly.

The workers are real: one ZeroMQ PUB socket and one HTTP port each, in a helper process
(:mod:`tests.support.fleet`); the router is the ``kvroute router`` command. A sample of
the workers (every 50th and the last registered) publishes, and the index must hold each
one's blocks.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from events.identity import WorkerId
from router.cluster.runner import ProcessGroup, wait_healthy
from router.index.redis_index import RedisPrefixIndex
from router.ingest.capacity import FDS_PER_WORKER, RESERVED_FDS
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.store.server import free_port
from tests.support.faults import python_m
from tests.support.fleet import BLOCKS, Fleet, register
from tests.support.ingest import keys
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

NUM_WORKERS = 1000
BOUND_S = 120.0


def test_one_router_registers_and_ingests_1000_workers(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    sample = [*range(0, NUM_WORKERS, 50), NUM_WORKERS - 1]
    prompts = {i: 10_000 + i for i in sample}  # a family of its own per sampled worker
    group = ProcessGroup(tmp_path, stop_timeout_s=10.0)

    async def scenario(fleet: Fleet, url: str) -> None:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, group, time.monotonic() + BOUND_S)
        statuses = await register(url, fleet.bodies)
        assert Counter(statuses) == {201: NUM_WORKERS}
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/workers") as r:
            assert len((await r.json())["workers"]) == NUM_WORKERS
        client = await connect(redis_url)
        try:
            index = RedisPrefixIndex(client, KeyLayout(namespace))
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


FD_LIMIT = RESERVED_FDS + 23 * FDS_PER_WORKER + 4
"""A router under this file descriptor limit (soft and hard) can take 23 workers."""
LIMITED = (
    "import os, resource, sys; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT})); "
    "os.execv(sys.executable, [sys.executable, '-m', 'router', *sys.argv[1:]])"
)


def test_a_worker_beyond_the_routers_capacity_is_refused_and_nothing_saved(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    group = ProcessGroup(tmp_path, stop_timeout_s=10.0)

    async def scenario(fleet: Fleet, url: str) -> None:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, group, time.monotonic() + BOUND_S)
        assert await register(url, fleet.bodies[:23]) == [201] * 23
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/workers", json=fleet.bodies[23]) as resp,
        ):
            assert resp.status == 503
            message = (await resp.json())["error"]["message"]
        assert "this router can ingest at most 23 workers, 24 asked for" in message
        assert f"file descriptor limit {FD_LIMIT}" in message
        assert "nothing was saved" in message
        client = await connect(redis_url)
        try:
            layout = KeyLayout(namespace)
            saved = {k.decode() for k in await client.hkeys(layout.registry)}
            assert saved == {f"f{i}" for i in range(23)}
            assert await client.exists(layout.lease(WorkerId("f23"))) == 0
        finally:
            await client.aclose()

    with Fleet(24) as fleet:
        port = free_port()
        try:
            group.start(
                "router",
                [sys.executable, "-c", LIMITED, "router", "--redis", redis_url,
                 "--namespace", namespace, "--port", str(port), "--log-level", "WARNING"],
            )  # fmt: skip
            asyncio.run(scenario(fleet, f"http://127.0.0.1:{port}"))
        finally:
            group.stop()


def test_a_router_configured_with_more_workers_than_it_can_take_exits_clearly(
    redis_url: str, namespace: str
) -> None:
    specs = [a for i in range(24) for a in ("--worker", f"c{i}=http://127.0.0.1:9,events=tcp://127.0.0.1:9")]
    argv = [sys.executable, "-c", LIMITED, "router", "--redis", redis_url,
            "--namespace", namespace, "--port", "0", *specs]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=BOUND_S)
    assert proc.returncode != 0
    assert "this router can ingest at most 23 workers, 24 asked for" in proc.stderr
