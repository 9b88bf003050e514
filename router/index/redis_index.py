"""``PrefixIndex`` in Redis (single node or Redis Cluster): the production global prefix index.

Layout (see :mod:`router.index.layout`): one Redis hash per router key, field = worker
id, value = tier mask, tagged with its prefix family so a request's chain lives on one
shard; one membership set per worker so clearing it is O(its blocks). Every write is
fenced by the worker's lease token (see :mod:`router.index.registry`): a router that
lost the lease cannot write.

Costs: a lookup is one ``EVALSHA`` walking the chain server-side; a batch is one
``EVALSHA`` on a single node, and on a cluster one call to the worker's shard (fencing +
membership) followed by one call per family shard, sent concurrently.

NOTE: on a cluster the fencing check and the block writes are separate scripts, so a
writer whose lease lapses between the two may leave the entries of that one batch
behind; the next resync or reap of the worker removes them only if they are in the
membership set, which the fenced script updated first.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Final

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from events.hashing import BlockKey, RouterKeyer
from events.schema import KVEventBatch
from router.errors import PrefixIndexError
from router.index.base import IndexStats, PrefixMatch, WorkerId
from router.index.bridge import Changes, EntryChange, WorkerBridge, fold_batch
from router.index.layout import KeyLayout, check_name, pack_member, unpack_member
from router.index.scripts import (
    APPLY_BLOCKS,
    APPLY_SINGLE,
    APPLY_WORKER,
    LOOKUP,
    RESET_WORKER,
    Script,
)
from router.redis_conn import RedisClient, reply_bytes

__all__ = ["RedisPrefixIndex"]

_MASK_DIGITS: Final = (b"0", b"1", b"2", b"3")
_CLEAR_CHUNK: Final = 2000
"""Members removed per fenced script call while clearing a worker."""

_apply_single = Script(APPLY_SINGLE)
_apply_worker = Script(APPLY_WORKER)
_apply_blocks = Script(APPLY_BLOCKS)
_reset_worker = Script(RESET_WORKER)
_lookup = Script(LOOKUP)


def _entries_delta(changes: Changes) -> int:
    return sum(c.new_mask.bit_count() - c.old_mask.bit_count() for c in changes.values())


class RedisPrefixIndex:
    """The global prefix index in Redis.

    Args:
        client: A connected client (see :func:`router.redis_conn.connect`).
        layout: Key names of the namespace.
        keyer: Router key function (its seed must match the one requests use).

    NOTE: only the holder of a worker's lease writes that worker's entries; the lease
    token is given with :meth:`use_lease` before :meth:`apply` or :meth:`clear_worker`.
    The engine-hash bridges live in this process and are rebuilt by resync after a
    restart.
    """

    def __init__(
        self,
        client: RedisClient,
        layout: KeyLayout | None = None,
        keyer: RouterKeyer | None = None,
    ) -> None:
        self.client = client
        self.layout = layout if layout is not None else KeyLayout()
        self.keyer = keyer if keyer is not None else RouterKeyer()
        self.is_cluster = isinstance(client, RedisCluster)
        self._tokens: dict[WorkerId, str] = {}
        self._bridges: dict[WorkerId, WorkerBridge] = {}

    def use_lease(self, worker_id: WorkerId, token: str) -> None:
        """Write the worker's entries under this lease token (``"<epoch>:<owner>"``)."""
        self._tokens[WorkerId(check_name("worker id", worker_id))] = token

    def forget_lease(self, worker_id: WorkerId) -> None:
        """Stop writing for the worker and drop its in-process bridge."""
        self._tokens.pop(worker_id, None)
        self._bridges.pop(worker_id, None)

    def bridge(self, worker_id: WorkerId) -> WorkerBridge:
        """The engine-hash bridge of a worker (created on first use)."""
        found = self._bridges.get(worker_id)
        if found is None:
            found = self._bridges[worker_id] = WorkerBridge(self.keyer)
        return found

    def _token(self, worker_id: WorkerId) -> str:
        token = self._tokens.get(worker_id)
        if token is None:
            raise PrefixIndexError(
                f"no lease for worker {worker_id!r}: acquire it with WorkerRegistry.acquire "
                "and pass its token to use_lease() before writing"
            )
        return token

    async def apply(self, worker_id: WorkerId, batch: KVEventBatch) -> None:
        """Apply one worker's event batch (see ``PrefixIndex.apply``).

        Raises:
            OrphanParentError: A ``BlockStored`` has an unknown parent.
            StaleLeaseError: This router no longer holds the worker's lease.
            PrefixIndexError: No lease token was given for the worker.
        """
        self._token(worker_id)

        async def write(changes: Changes) -> None:
            await self._write(worker_id, changes)

        async def clear() -> None:
            await self.clear_worker(worker_id)

        await fold_batch(worker_id, self.bridge(worker_id), batch, write, clear)

    async def _write(self, worker_id: WorkerId, changes: Changes) -> None:
        token = self._token(worker_id)
        lay = self.layout
        worker_keys = [lay.lease(worker_id), lay.members(worker_id), lay.worker(worker_id)]
        records = [pack_member(c.tag, c.key) + _MASK_DIGITS[c.new_mask] for c in changes.values()]
        delta = _entries_delta(changes)
        prefix = lay.block_prefix()
        if not self.is_cluster:
            await _apply_single(
                self.client,
                [*worker_keys, lay.stats],
                [token, worker_id, delta, prefix, b"".join(records)],
            )
            return
        await _apply_worker(self.client, worker_keys, [token, delta, b"".join(records)])
        groups: dict[int, tuple[bytes, list[bytes]]] = {}
        for change, record in zip(changes.values(), records, strict=True):
            name = lay.block(change.tag, change.key)
            groups.setdefault(key_slot(name), (name, []))[1].append(record)
        created = await asyncio.gather(
            *(
                _apply_blocks(self.client, [name], [worker_id, prefix, b"".join(group)])
                for name, group in groups.values()
            )
        )
        if sum(created):
            await self.client.hincrby(lay.stats, "keys", sum(created))

    async def lookup(
        self, keys: Sequence[BlockKey], workers: Sequence[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatch]:
        """Longest held prefix per candidate, in one round trip (see ``PrefixIndex.lookup``)."""
        if not keys or (workers is not None and not workers):
            return {}
        tag = keys[0]
        packed = struct.pack(f">{len(keys)}Q", *keys)
        fields = [] if workers is None else list(dict.fromkeys(workers))
        reply: list[Any] = await _lookup(
            self.client,
            [self.layout.block(tag, tag)],
            [self.layout.family_prefix(tag), packed, *fields],
        )
        out: dict[WorkerId, PrefixMatch] = {}
        for i in range(0, len(reply), 3):
            gpu, cpu = int(reply[i + 1]), int(reply[i + 2])
            out[WorkerId(reply[i].decode())] = PrefixMatch(gpu + cpu, gpu, cpu)
        return out

    async def clear_worker(self, worker_id: WorkerId) -> None:
        """Drop every entry of one worker, found through its membership set.

        Costs O(its entries) in chunks of fenced writes; entries the bridge does not know
        (written before a router restart) are removed too.

        Raises:
            StaleLeaseError: This router no longer holds the worker's lease.
        """
        token = self._token(worker_id)
        bridge = self._bridges.get(worker_id)
        if bridge is not None:
            bridge.reset()
        lay = self.layout
        while True:
            chunk = await self.client.srandmember(lay.members(worker_id), _CLEAR_CHUNK)
            if not chunk:
                break
            changes: Changes = {}
            for member in chunk:
                tag, key = unpack_member(reply_bytes(member))
                changes[key] = EntryChange(key, tag, 0, 0)
            await self._write(worker_id, changes)
        await _reset_worker(
            self.client,
            [lay.lease(worker_id), lay.members(worker_id), lay.worker(worker_id)],
            [token],
        )

    async def worker_entries(self, worker_id: WorkerId) -> dict[BlockKey, int]:
        """Every entry of one worker in Redis: router key -> tier mask (for checks)."""
        lay = self.layout
        members = self.client.sscan_iter(lay.members(worker_id), count=1000)
        tags_keys = [unpack_member(reply_bytes(m)) async for m in members]
        masks = await asyncio.gather(
            *(self.client.hget(lay.block(tag, key), worker_id) for tag, key in tags_keys)
        )
        return {key: int(mask) for (_, key), mask in zip(tags_keys, masks, strict=True) if mask}

    async def stats(self) -> IndexStats:
        """Entries and distinct keys of the namespace; memory is the servers' ``used_memory``."""
        lay = self.layout
        indexed = await self.client.smembers(lay.indexed)
        workers = [WorkerId(reply_bytes(w).decode()) for w in indexed]
        counts = await asyncio.gather(
            *(self.client.hget(lay.worker(w), "entries") for w in workers)
        )
        num_keys = await self.client.hget(lay.stats, "keys")
        entries = [int(c) for c in counts if c is not None]
        return IndexStats(
            num_entries=sum(entries),
            num_keys=int(num_keys or 0),
            num_workers=sum(1 for c in entries if c > 0),
            memory_bytes=await self._used_memory(),
        )

    async def _used_memory(self) -> int:
        if isinstance(self.client, RedisCluster):
            info = await self.client.info("memory", target_nodes=RedisCluster.PRIMARIES)
            return sum(int(node["used_memory"]) for node in info.values())
        return int((await self.client.info("memory"))["used_memory"])
