"""A single-node write larger than one script call splits between families, each part
fenced, and lands exactly as one call would."""

from __future__ import annotations

import asyncio

import pytest

from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.schema import BlockRemoved, BlockStored, KVEventBatch
from router.index import redis_index
from router.index.group_commit import GroupCommitIndex
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRegistry
from tests.support.index_env import drop_namespace

BS = 4
KEYER = RouterKeyer()
WORKERS = [WorkerId("split-a"), WorkerId("split-b")]


def prompt(first: int, num_blocks: int, base: int) -> BlockStored:
    """A chain of ``num_blocks`` blocks from block 0 (its own family)."""
    return BlockStored(
        block_hashes=[base + i for i in range(num_blocks)],
        parent_block_hash=None,
        token_ids=list(range(first, first + num_blocks * BS)),
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


@pytest.mark.slow
@pytest.mark.parametrize("group_commit", [False, True])
def test_write_split_over_calls_equals_one_call(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch, group_commit: bool
) -> None:
    monkeypatch.setattr(redis_index, "_MAX_WRITE_ARGS", 20)

    async def main() -> None:
        client = await connect(redis_url)
        layout = KeyLayout(namespace)
        store = RedisPrefixIndex(client, layout)
        index = BridgedIndex(GroupCommitIndex(store) if group_commit else store)
        registry = WorkerRegistry(client, layout)
        try:
            for worker in WORKERS:
                lease = await registry.acquire(worker)
                assert lease is not None
                index.use_lease(worker, lease.token)
            # Per worker: one family of 40 blocks (past the limit on its own) and five
            # small ones, then a removal that spans two of them.
            for n, worker in enumerate(WORKERS):
                events: list[BlockStored | BlockRemoved] = [prompt(1_000 * n, 40, 10_000 * n)]
                events += [
                    prompt(100_000 + 1_000 * f, 3, 10_000 * n + 100 * (f + 1)) for f in range(5)
                ]
                await index.apply(worker, KVEventBatch(ts=1.0, events=events))
                gone = BlockRemoved(
                    block_hashes=[10_000 * n + 39, 10_000 * n + 38, 10_000 * n + 102], medium="GPU"
                )
                await index.apply(worker, KVEventBatch(ts=2.0, events=[gone]))
            await index.flush()
            total = 0
            for n, worker in enumerate(WORKERS):
                expected = {k: mask for k, (_, mask) in index.bridge(worker).entries().items()}
                assert len(expected) == 40 - 2 + 5 * 3 - 1
                assert await index.worker_entries(worker) == expected
                total += len(expected)
                keys = KEYER.keys(list(range(1_000 * n, 1_000 * n + 40 * BS)), BS)
                match = (await index.lookup(keys, [worker]))[worker]
                assert match.num_gpu_blocks == 38
            assert (await index.stats()).num_entries == total
        finally:
            await index.close()
            await drop_namespace(client, layout)
            await client.aclose()

    asyncio.run(main())
