"""Redis that loses its data is repaired from what the router holds: restarted empty, or one
cluster shard flushed while the leases on the others survive.

The router's markers (:mod:`router.store.markers`) tell it a node lost its data; it then
writes every held worker's entries again from its bridge, for kvroute workers and vLLM
engines alike, and no batch delivered meanwhile is dropped.
"""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis.crc import key_slot

from events.identity import WorkerId
from router.store.layout import KeyLayout
from router.store.server import RedisServer, free_port
from tests.support.ingest import (
    BLOCKS_PER_PROMPT,
    FakeWorker,
    divergent,
    fake_workers,
    keys,
    lookup_is,
    match,
    stack,
    stored,
)
from tests.support.polling import eventually
from tests.support.redis_cluster import SLOT_RANGES, redis_cluster

pytestmark = pytest.mark.slow

BOUND_S = 30.0
"""Longest wait for a repair ("within seconds", on a loaded 2-core machine)."""
NUM_PROMPTS = 12


def test_redis_restarted_empty_is_rewritten_from_the_routers_state(namespace: str) -> None:
    """A vLLM engine that publishes nothing after the restart is indexed again, and so is
    a kvroute worker (without a snapshot load); the first batch after the restart counts."""

    async def main() -> None:
        port = free_port()
        server = RedisServer(port=port).start()
        try:
            async with (
                fake_workers(FakeWorker("v1", kind="vllm"), FakeWorker("k1")) as (v1, k1),
                stack(server.url, namespace, [v1.record(), k1.record()]) as s,
            ):
                await s.handshake(v1, k1)
                v1.publish(stored(1, 0, BLOCKS_PER_PROMPT))
                k1.publish(stored(2, 0, BLOCKS_PER_PROMPT))
                full = match(BLOCKS_PER_PROMPT)
                await eventually(lookup_is(s.index, 1, {"v1": full}), what="v1 indexed")
                await eventually(lookup_is(s.index, 2, {"k1": full}), what="k1 indexed")
                snapshots = s.count("snapshots", worker="k1", outcome="ok")

                server.stop()
                server = RedisServer(port=port).start()  # empty
                assert dict(await s.index.lookup(keys(1))) == {}
                k1.publish(stored(3, 0, BLOCKS_PER_PROMPT))  # the first batch after it

                await eventually(lookup_is(s.index, 1, {"v1": full}), what="v1 restored",
                                 timeout_s=BOUND_S)  # fmt: skip
                await eventually(lookup_is(s.index, 2, {"k1": full}), what="k1 restored",
                                 timeout_s=BOUND_S)  # fmt: skip
                await eventually(lookup_is(s.index, 3, {"k1": full}), what="k1's new batch",
                                 timeout_s=BOUND_S)  # fmt: skip
                assert await divergent(s.index, k1) == 0
                assert s.count("restores", worker="v1") == 1
                assert s.count("restores", worker="k1") == 1
                assert s.count("snapshots", worker="k1", outcome="ok") == snapshots
                assert s.count("batches", worker="k1", outcome="failed") == 0
                assert s.metrics.registry.get_sample_value("kvroute_index_data_losses_total") == 1
                # Registrations are saved again too.
                assert [r.worker_id for r in await s.registry.records()] == ["k1", "v1"]
        finally:
            server.stop()

    asyncio.run(main())


def _shard_of(key: str) -> int:
    slot = key_slot(key.encode())
    return next(i for i, (first, last) in enumerate(SLOT_RANGES) if first <= slot <= last)


def test_a_flushed_cluster_shard_is_rewritten_while_the_leases_survive(namespace: str) -> None:
    layout = KeyLayout(namespace)
    workers = {"k1": "kvroute", "v1": "vllm"}
    lease_shards = {_shard_of(layout.lease(WorkerId(w))) for w in workers}
    flushed = next(i for i in range(len(SLOT_RANGES)) if i not in lease_shards)
    prompts = range(10, 10 + NUM_PROMPTS)

    async def main(servers: list[RedisServer]) -> None:
        async with (
            fake_workers(FakeWorker("k1"), FakeWorker("v1", kind="vllm")) as (k1, v1),
            stack(servers[0].url, namespace, [k1.record(), v1.record()]) as s,
        ):
            await s.handshake(k1, v1)
            for prompt in prompts:  # each worker holds every prompt
                k1.publish(stored(prompt, 0, BLOCKS_PER_PROMPT))
                v1.publish(stored(prompt, 0, BLOCKS_PER_PROMPT))
            both = {"k1": match(BLOCKS_PER_PROMPT), "v1": match(BLOCKS_PER_PROMPT)}
            for prompt in prompts:
                await eventually(lookup_is(s.index, prompt, both), what=f"prompt {prompt}")
            on_flushed = [p for p in prompts if _shard_of(layout.holders(keys(p)[0])) == flushed]
            assert on_flushed, "no prompt's family on the flushed shard: pick other prompts"
            leases = await s.client.get(layout.lease(WorkerId("k1")))

            shard = redis.Redis(host=servers[flushed].host, port=servers[flushed].port)
            shard.flushall()
            shard.close()
            assert dict(await s.index.lookup(keys(on_flushed[0]))) == {}

            for prompt in prompts:
                await eventually(lookup_is(s.index, prompt, both), what=f"prompt {prompt} again",
                                 timeout_s=BOUND_S)  # fmt: skip
            assert await divergent(s.index, k1) == 0
            assert await s.client.get(layout.lease(WorkerId("k1"))) == leases  # survived
            assert s.count("restores", worker="k1") == 1
            assert s.count("restores", worker="v1") == 1

    with redis_cluster() as servers:
        asyncio.run(main(servers))
