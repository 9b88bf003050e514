"""Property: any interleaving of events for several workers leaves the index equal to a model.

The model is the plain truth of each worker's pool: a multiset of (block, tier) copies.
Events: stores (single and multi-block, duplicates, orphans), removals (including of
copies never stored), ``AllBlocksCleared``, and replays (clear the worker, re-apply its
history). Checked after every batch: each worker's entries, every prefix lookup, stats.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.hashing import BlockKey
from events.identity import WorkerId
from events.schema import AllBlocksCleared, BlockRemoved, KVEventBatch
from router.errors import OrphanParentError
from router.index.base import PrefixMatch
from tests.support.index_env import IndexEnv, OpenIndex
from tests.support.prefix_tree import KEY, PARENT, TIERS, event_st, path

pytestmark = pytest.mark.slow

WORKERS = [WorkerId("a"), WorkerId("b"), WorkerId("c")]


class Model:
    """Each worker's physical copies per (node, tier)."""

    def __init__(self) -> None:
        self.copies: dict[WorkerId, Counter[tuple[int, int]]] = {w: Counter() for w in WORKERS}

    def holds(self, worker: WorkerId, node: int) -> int:
        return sum(t for t in TIERS if self.copies[worker][(node, t)] > 0)

    def apply(self, worker: WorkerId, event: Any) -> bool:
        """Apply one event; False for an orphan (rejected, nothing changes)."""
        copies = self.copies[worker]
        if isinstance(event, AllBlocksCleared):
            copies.clear()
        elif isinstance(event, BlockRemoved):
            tier = 1 if event.medium == "GPU" else 2
            for h in event.block_hashes:
                if copies[(h - 1000, tier)] > 0:
                    copies[(h - 1000, tier)] -= 1
        else:
            parent = event.parent_block_hash
            if parent is not None and not self.holds(worker, parent - 1000):
                return False
            tier = 1 if event.medium == "GPU" else 2
            for h in event.block_hashes:
                copies[(h - 1000, tier)] += 1
        return True

    def entries(self, worker: WorkerId) -> dict[BlockKey, int]:
        """Indexed entries: held blocks whose whole prefix is held (prefix closure)."""
        return {
            KEY[n]: self.holds(worker, n)
            for n in PARENT
            if all(self.holds(worker, p) for p in path(n))
        }

    def match(self, node: int) -> dict[WorkerId, PrefixMatch]:
        out = {}
        for worker in WORKERS:
            gpu = cpu = 0
            for n in path(node):
                mask = self.holds(worker, n)
                if not mask:
                    break
                gpu, cpu = (gpu + 1, cpu) if mask & 1 else (gpu, cpu + 1)
            if gpu + cpu:
                out[worker] = PrefixMatch(gpu + cpu, gpu, cpu)
        return out


step_st = st.one_of(
    st.tuples(
        st.just("batch"), st.sampled_from(WORKERS), st.lists(event_st, min_size=1, max_size=4)
    ),
    st.tuples(st.just("replay"), st.sampled_from(WORKERS), st.just([])),
)


async def check(env: IndexEnv, model: Model) -> None:
    await env.settle()
    index = env.index
    for worker in WORKERS:
        assert await index.worker_entries(worker) == model.entries(worker)
    for node in PARENT:
        keys = [KEY[n] for n in path(node)]
        assert await index.lookup(keys) == model.match(node)
        assert await index.lookup(keys, WORKERS[:2]) == {
            w: m for w, m in model.match(node).items() if w in WORKERS[:2]
        }
    stats = await index.stats()
    entries = sum(bin(m).count("1") for w in WORKERS for m in model.entries(w).values())
    keys_held = {k for w in WORKERS for k in model.entries(w)}
    num_workers = sum(1 for w in WORKERS if model.entries(w))
    assert (stats.num_entries, stats.num_keys, stats.num_workers) == (
        entries,
        len(keys_held),
        num_workers,
    )


async def play(env: IndexEnv, steps: list[tuple[str, WorkerId, list[Any]]]) -> None:
    model = Model()
    history: dict[WorkerId, list[Any]] = {w: [] for w in WORKERS}
    for worker in WORKERS:
        await env.prepare(worker)
    for step, (kind, worker, events) in enumerate(steps):
        if kind == "replay":
            await env.index.clear_worker(worker)
            await env.index.apply(worker, KVEventBatch(1.0, list(history[worker])))
        else:
            applied = []
            for event in events:
                if not model.apply(worker, event):
                    break
                applied.append(event)
            if len(applied) < len(events):
                with pytest.raises(OrphanParentError) as info:
                    await env.index.apply(worker, KVEventBatch(1.0, events))
                assert info.value.num_applied == len(applied)
            else:
                await env.index.apply(worker, KVEventBatch(1.0, events))
            for event in applied:
                if isinstance(event, AllBlocksCleared):
                    history[worker].clear()
                else:
                    history[worker].append(event)
        if step % 2 == 1:  # every other step, so group commit merges batches in between
            await check(env, model)
    await check(env, model)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(step_st, min_size=1, max_size=12))
def test_any_interleaving_equals_the_model(
    open_index: OpenIndex, steps: list[tuple[str, WorkerId, list[Any]]]
) -> None:
    async def main() -> None:
        async with open_index() as env:
            await play(env, steps)

    asyncio.run(main())
