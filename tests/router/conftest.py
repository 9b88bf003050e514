"""Router test fixtures: a local three-master Redis Cluster on free loopback ports.

The Redis Cluster variants of parametrized tests are in the slow tier (``-m slow``): the
fast tier runs the same tests in memory and on a single Redis node.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest

from router.index.base import PrefixIndex
from router.index.memory import MemoryPrefixIndex
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRegistry
from tests.support.index_env import IndexEnv, OpenIndex, SettledGroupCommit, drop_namespace
from tests.support.redis_cluster import redis_cluster

_CLUSTER = pytest.param("cluster", marks=pytest.mark.slow)


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """URL of one node of a private three-master Redis Cluster (slots assigned here)."""
    with redis_cluster() as servers:
        yield servers[0].url


CONTRACT_LEASE_TTL_MS = 300_000
"""The contract tests' leases are never renewed: long enough for a loaded machine (a 10 s
lease lapsed while a test of thousands of families ran under load), while the lease tests
(tests/router/workers/test_index_registry.py) use their own."""


def _opener(request: pytest.FixtureRequest, namespace: str) -> OpenIndex:
    kind: str = request.param
    store_kind, _, wrapper = kind.partition("-")
    url = None
    if store_kind == "redis":
        url = request.getfixturevalue("redis_url")
    elif store_kind == "cluster":
        url = request.getfixturevalue("redis_cluster_url")

    def wrapped(store: PrefixIndex) -> PrefixIndex:
        return SettledGroupCommit(store) if wrapper == "group-commit" else store

    @asynccontextmanager
    async def factory() -> AsyncIterator[IndexEnv]:
        if url is None:
            yield IndexEnv(BridgedIndex(wrapped(MemoryPrefixIndex())))
            return
        client = await connect(url)
        layout = KeyLayout(namespace)
        index = BridgedIndex(wrapped(RedisPrefixIndex(client, layout)))
        try:
            registry = WorkerRegistry(client, layout, lease_ttl_ms=CONTRACT_LEASE_TTL_MS)
            yield IndexEnv(index, registry)
        finally:
            await index.close()
            await drop_namespace(client, layout)
            await client.aclose()

    return factory


@pytest.fixture(params=["memory", "redis", _CLUSTER, "memory-group-commit", "redis-group-commit"])
def open_index(request: pytest.FixtureRequest, namespace: str) -> OpenIndex:
    """Opens the store under test behind the workers' bridges: in memory, Redis single
    node, Redis Cluster, and memory and Redis wrapped in group commit (their lookups wait
    for the queued writes: :class:`~tests.support.index_env.SettledGroupCommit`)."""
    return _opener(request, namespace)
