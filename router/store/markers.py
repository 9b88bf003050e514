"""Data markers: one small hash per Redis node, so a router can tell that a node lost its data.

A Redis without persistence that restarts comes back empty, and a cluster shard whose
master restarts without a replica does too, while the other shards keep theirs. Nothing
else tells a router so: its leases on the other shards renew, and a worker that publishes
nothing more never writes again. Each router sets its own field (its id) in one marker
hash per node (a cluster: per master, the hash tag chosen so the key lands in one of its
slots) when it starts, and checks them every maintenance pass: a field gone means that
node lost whatever it held, so the router writes again what it knows
(:mod:`router.ingest.service`). Checking costs one ``HEXISTS`` per node.
"""

from __future__ import annotations

import itertools
from typing import Final

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from router.errors import RouterError
from router.store.connection import RedisClient
from router.store.layout import KeyLayout

__all__ = ["DataMarkers"]

_MAX_TAGS: Final = 1 << 16
"""Tags tried to find one per master (16,384 slots: a few dozen suffice for any layout)."""


class DataMarkers:
    """The marker hashes of one namespace and one router.

    Args:
        client: A single-node or cluster client.
        layout: Key names of the namespace.
        owner: This router's id (its field in every marker hash).
    """

    def __init__(self, client: RedisClient, layout: KeyLayout, owner: str) -> None:
        self.client = client
        self.layout = layout
        self.owner = owner

    def keys(self) -> list[str]:
        """One marker key per node (per master on a cluster, as its slot map says now)."""
        client = self.client
        if not isinstance(client, RedisCluster):
            return [self.layout.marker("0")]
        masters = {node.name for node in client.get_primaries()}
        found: dict[str, str] = {}
        for i in itertools.islice(itertools.count(), _MAX_TAGS):
            key = self.layout.marker(str(i))
            node = client.nodes_manager.get_node_from_slot(key_slot(key.encode()))
            if node is not None and node.name in masters:
                found.setdefault(node.name, key)
            if len(found) == len(masters):
                return sorted(found.values())
        raise RouterError(f"no marker key found for every Redis master among {sorted(masters)}")

    async def write(self) -> None:
        """Set this router's field in every marker hash.

        Raises:
            redis.exceptions.RedisError: Redis failed.
        """
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys():
            pipe.hset(key, self.owner, 1)
        await pipe.execute()

    async def lost(self) -> list[str]:
        """The marker keys that lost this router's field since :meth:`write` (empty: no
        node lost its data).

        Raises:
            redis.exceptions.RedisError: Redis failed.
        """
        keys = self.keys()
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hexists(key, self.owner)
        found = await pipe.execute()
        return [key for key, present in zip(keys, found, strict=True) if not present]
