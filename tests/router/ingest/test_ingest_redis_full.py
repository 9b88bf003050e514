"""Ingest against a Redis that is full (``maxmemory`` with ``noeviction``) or down: it
backs off, says so once per interval, shows it in ``/health`` and ``/metrics``, asks no
worker for a snapshot meanwhile, and converges with a rebuild of each worker once Redis
has room (or answers) again.

A real router service in process, a private ``redis-server``, a real publisher and worker
HTTP. The log lines are counted while batches keep coming at a full Redis: before, each
batch cost a failed write, a resync, a snapshot fetch and another failed write, each
logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from redis.exceptions import OutOfMemoryError

from router.front.config import RouterConfig
from router.front.service import RouterService
from router.store.connection import connect
from router.store.server import RedisServer
from tests.support.ingest import (
    LifetimeWorker,
    divergent,
    fake_workers,
    lookup_is,
    match,
    sample,
    stored,
    streams_up,
)
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

FULL_FOR_S = 4.0
"""How long batches keep coming at the full Redis."""
MAX_WARNINGS = 4
"""In those seconds: the index's (once per 10 s interval), shared load's, the heartbeat's."""
MAX_UNREACHABLE_WARNINGS = 8
"""Redis down for those seconds: the write gate's one, and the other parts' first word of
it (lookup, shared load, heartbeat, lease renewal, maintenance), each once."""


async def health(client: aiohttp.ClientSession) -> dict[str, Any]:
    async with client.get("/health") as resp:
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


def total(svc: RouterService, name: str, **labels: str) -> float:
    """A counter's sum over the label values not given."""
    return sum(
        s.value
        for family in svc.metrics.registry.collect()
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


@asynccontextmanager
async def ingesting(
    redis_url: str, namespace: str
) -> AsyncIterator[tuple[RouterService, aiohttp.ClientSession, LifetimeWorker]]:
    """A router service (and a client of it) ingesting one worker, ``k1``, whose first
    prompt is already indexed."""
    async with fake_workers(LifetimeWorker("k1")) as (k1,):
        config = RouterConfig(
            redis_url=redis_url, namespace=namespace, port=0, workers=(k1.record(),),
            lease_ttl_s=1.5,
        )  # fmt: skip
        async with (
            await RouterService.open(config) as svc,
            aiohttp.ClientSession(base_url=svc.url) as client,
        ):
            await streams_up(svc, k1)
            k1.publish(stored(1, 0, 3))
            await eventually(lookup_is(svc.ingest.index, 1, {"k1": match(3)}), what="ingested")
            yield svc, client, k1


def warned(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The warnings (and worse) kvroute logged since the last ``caplog.clear()``."""
    return [
        r for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith(("router", "events"))
    ]  # fmt: skip


async def keep_publishing(svc: RouterService, worker: LifetimeWorker) -> None:
    """Publish a batch at a time for ``FULL_FOR_S``, each received before the next."""
    end, prompt = time.monotonic() + FULL_FOR_S, 10
    while time.monotonic() < end:
        seen = sample(svc, "kvroute_stream_batches_total", worker=worker.worker_id)
        worker.publish(stored(prompt, 0, 2))
        prompt += 1

        async def received(seen: float = seen) -> bool:
            now = sample(svc, "kvroute_stream_batches_total", worker=worker.worker_id)
            return now > seen

        await eventually(received, what="a batch while Redis refuses writes")


async def recovered(
    svc: RouterService, client: aiohttp.ClientSession, worker: LifetimeWorker
) -> None:
    """Wait until the index is live again and holds exactly the worker's cache."""

    async def converged() -> bool:
        worker.publish()
        health_now = await health(client)
        return health_now["index"] == "live" and not await divergent(svc.ingest.index, worker)

    await eventually(converged, what="recovered", timeout_s=60)


def test_a_full_redis_is_backed_off_said_once_and_recovered_from(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        admin = await connect(private_redis.url)
        try:
            async with ingesting(private_redis.url, "full") as (svc, client, k1):
                assert (await health(client))["index"] == "live"

                # Fill Redis (keys outside kvroute's namespace) until it refuses writes.
                used = int((await admin.info("memory"))["used_memory"])
                await admin.config_set("maxmemory-policy", "noeviction")
                await admin.config_set("maxmemory", used + 1_000_000)
                with pytest.raises(OutOfMemoryError):
                    for i in range(10_000):
                        await admin.set(f"filler:{i}", b"x" * 10_000)
                snapshots = total(svc, "kvroute_ingest_snapshots_total", outcome="ok")
                resyncs = total(svc, "kvroute_ingest_resyncs_total")
                caplog.clear()

                await keep_publishing(svc, k1)
                warnings = warned(caplog)
                full = await health(client)
                async with client.get("/metrics") as resp:
                    exposition = await resp.text()
                assert total(svc, "kvroute_ingest_resyncs_total") == resyncs
                assert total(svc, "kvroute_ingest_snapshots_total", outcome="ok") == snapshots
                dropped = sample(
                    svc, "kvroute_ingest_batches_total", worker="k1", outcome="index_full"
                )

                # Room again: the ingest resumes and rebuilds the worker once.
                await admin.config_set("maxmemory", 0)

                await recovered(svc, client, k1)
                assert total(svc, "kvroute_ingest_snapshots_total", outcome="ok") == (snapshots + 1)
                assert total(svc, "kvroute_ingest_resyncs_total") == resyncs + 1
                assert sample(svc, "kvroute_index_writable") == 1
        finally:
            await admin.aclose()
        assert len(warnings) <= MAX_WARNINGS, [r.getMessage() for r in warnings]
        assert any("out of memory" in r.getMessage() for r in warnings)
        assert (full["status"], full["index"], full["index_writable"]) == (
            "degraded",
            "full",
            False,
        )
        assert 'kvroute_index_write_errors_total{reason="oom"}' in exposition
        assert "kvroute_index_writable 0.0" in exposition
        assert dropped >= 1

    asyncio.run(main())


def test_a_redis_that_is_down_is_backed_off_said_once_and_recovered_from(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis killed while batches keep coming, then started again empty on its port."""

    async def main() -> None:
        async with ingesting(private_redis.url, "down") as (svc, client, k1):
            private_redis.stop()
            caplog.clear()

            async def shut() -> bool:
                k1.publish(stored(2, 0, 2))
                return sample(svc, "kvroute_index_writable") == 0

            await eventually(shut, what="the write gate to shut")
            asked = total(svc, "kvroute_ingest_snapshots_total")
            await keep_publishing(svc, k1)
            down = await health(client)
            async with client.get("/metrics") as resp:
                exposition = await resp.text()
            during = total(svc, "kvroute_ingest_snapshots_total") - asked
            dropped = sample(svc, "kvroute_ingest_batches_total", worker="k1", outcome="index_full")
            warnings = warned(caplog)

            private_redis.start()  # empty: no lease, no entry

            await recovered(svc, client, k1)  # rebuilt, or restored from its bridge
        assert during == 0  # no worker was asked for its snapshot while Redis was down
        assert dropped >= 1
        assert (down["index"], down["index_writable"]) == ("degraded", False)
        assert 'kvroute_index_write_errors_total{reason="unreachable"}' in exposition
        messages = [r.getMessage() for r in warnings]
        assert sum("Redis is unreachable" in m for m in messages) <= 1, messages
        assert len(warnings) <= MAX_UNREACHABLE_WARNINGS, messages

    asyncio.run(main())
