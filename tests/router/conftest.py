"""Router test fixtures: a local three-master Redis Cluster on free loopback ports.

The Redis Cluster variants of parametrized tests are in the slow tier (``-m slow``): the
fast tier runs the same tests in memory and on a single Redis node.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest

from router.index.memory import MemoryPrefixIndex
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRegistry
from tests.support.index_env import IndexEnv, OpenIndex, drop_namespace
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
    kind = request.param
    url = None
    if kind in ("redis", "redis-group-commit"):
        url = request.getfixturevalue("redis_url")
    elif kind == "cluster":
        url = request.getfixturevalue("redis_cluster_url")

    @asynccontextmanager
    async def factory() -> AsyncIterator[IndexEnv]:
        if url is None:
            yield IndexEnv(BridgedIndex(MemoryPrefixIndex()))
            return
        client = await connect(url)
        layout = KeyLayout(namespace)
        index = BridgedIndex(
            RedisPrefixIndex(client, layout, group_commit=kind == "redis-group-commit")
        )
        try:
            registry = WorkerRegistry(client, layout, lease_ttl_ms=CONTRACT_LEASE_TTL_MS)
            yield IndexEnv(index, registry)
        finally:
            await index.close()
            await drop_namespace(client, layout)
            await client.aclose()

    return factory


@pytest.fixture(params=["memory", "redis", _CLUSTER])
def open_index(request: pytest.FixtureRequest, namespace: str) -> OpenIndex:
    """Opens the index kind under test: in memory, Redis single node, Redis Cluster."""
    return _opener(request, namespace)


@pytest.fixture(params=["memory", "redis", _CLUSTER, "redis-group-commit"])
def open_any_index(request: pytest.FixtureRequest, namespace: str) -> OpenIndex:
    """Like ``open_index``, plus Redis with group commit (call ``IndexEnv.settle``)."""
    return _opener(request, namespace)
