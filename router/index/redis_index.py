"""``PrefixIndex`` in Redis (single node or Redis Cluster): the production global prefix index.

Layout (see :mod:`router.store.layout`): per prefix family and worker, two sets of the
router keys it holds (GPU tier, CPU tier), stored by Redis as 8-byte-per-key intsets; per
family, a hash of holder counts; per worker, the list of its families, so clearing a
worker costs O(its families), never a keyspace scan. Every write is fenced by the
worker's lease token (see :mod:`router.workers.registry`): a router that lost the lease
cannot write.

Costs: a lookup is one ``EVALSHA`` on the family's shard: one ``HKEYS``/``HMGET`` for
the candidates, then, per candidate holding the family, a binary search of its matched
depth with ``SISMEMBER`` (the bridge keeps each chain's entries prefix-closed), plus one
``SMISMEMBER`` for the tier split when the worker has CPU-tier entries there. A write is
one ``EVALSHA`` on a single node, for any number of workers (``write_many``, which group
commit sends every worker's pending changes with, each fenced by its own lease; a burst is
split between families every ``_MAX_WRITE_ARGS`` arguments); on a cluster, per worker, one
call to the worker's shard (fencing + bookkeeping) followed by one call per family shard,
all sent concurrently.

NOTE: on a cluster the fencing check and the family writes are separate scripts, so a
writer whose lease lapses between the two may write that one batch after a newer owner
cleared the worker; its families were recorded in the worker's family list first, so
the next clear of the worker removes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from events.hashing import BlockKey
from events.identity import WorkerId
from router.errors import PrefixIndexError
from router.index.base import IndexStats, PrefixMatch
from router.index.changes import CPU_MASK, GPU_MASK, Changes, KeyLists
from router.store.connection import RedisClient, arg_packer, gather_bounded, reply_bytes
from router.store.layout import KeyLayout, check_name, decode_key, encode_keys_fixed, tag_text
from router.store.scripts import (
    APPLY_FAMILIES,
    APPLY_WORKER,
    APPLY_WORKERS,
    CLEAR_FAMILIES,
    FORGET_FAMILIES,
    LOOKUP,
    Script,
    StaleLeaseError,
)

__all__ = ["RedisPrefixIndex"]

_CLEAR_CHUNK: Final = 500
"""Families dropped per script call while clearing a worker."""
_MAX_WRITE_ARGS: Final = 16_384
"""Arguments after which a single-node write closes its script call and opens another
(about 8 ms of Redis time at most: lookups are not held up behind a burst)."""

_apply_workers = Script(APPLY_WORKERS)
_apply_worker = Script(APPLY_WORKER)
_apply_families = Script(APPLY_FAMILIES)
_clear_families = Script(CLEAR_FAMILIES)
_forget_families = Script(FORGET_FAMILIES)
_lookup = Script(LOOKUP)


Packer = Callable[[list[BlockKey]], object] | None
"""Packs a key list into one argument object its connection sends as that many arguments
(:func:`router.redis_conn.arg_packer`), or None: the keys go one argument each."""


def _append_family(
    tag: BlockKey, lists: KeyLists, args: list[Any], pack: Packer
) -> tuple[int, int]:
    """Append one family's script arguments (see ``_FAMILY`` in
    :mod:`router.store.scripts`: tag, the four list lengths, the four key lists) to
    ``args``; returns the change of the worker's entry count and the number of arguments
    appended (its keys packed by ``pack`` count one each)."""
    counts = [len(keys) for keys in lists]
    args.append(tag_text(tag))
    args.extend(counts)
    for keys in lists:
        if pack is None:
            args.extend(keys)
        elif keys:
            args.append(pack(keys))
    return counts[0] - counts[1] + counts[2] - counts[3], 5 + sum(counts)


class RedisPrefixIndex:
    """The global prefix index in Redis.

    Args:
        client: A connected client (see :func:`router.redis_conn.connect`).
        layout: Key names of the namespace.

    NOTE: only the holder of a worker's lease writes that worker's entries; the lease
    token is given with :meth:`use_lease` before :meth:`write` or :meth:`clear_worker`.
    """

    def __init__(self, client: RedisClient, layout: KeyLayout | None = None) -> None:
        self.client = client
        self.layout = layout if layout is not None else KeyLayout()
        self.is_cluster = isinstance(client, RedisCluster)
        self._tokens: dict[WorkerId, str] = {}
        self._pack = None if self.is_cluster else arg_packer(client)

    def use_lease(self, worker_id: WorkerId, token: str) -> None:
        """Write the worker's entries under this lease token (``"<epoch>:<owner>"``)."""
        self._tokens[WorkerId(check_name("worker id", worker_id))] = token

    def forget_lease(self, worker_id: WorkerId) -> None:
        """Stop writing for the worker."""
        self._tokens.pop(worker_id, None)

    async def flush(self, worker_id: WorkerId | None = None) -> None:
        """Nothing is queued: a write returns once Redis has it (see ``PrefixIndex.flush``)."""

    async def close(self) -> None:
        """Nothing runs in the background (the client is the caller's to close)."""

    def _token(self, worker_id: WorkerId) -> str:
        token = self._tokens.get(worker_id)
        if token is None:
            raise PrefixIndexError(
                f"no lease for worker {worker_id!r}: acquire it with WorkerRegistry.acquire "
                "and pass its token to use_lease() before writing"
            )
        return token

    def _worker_keys(self, worker_id: WorkerId) -> list[str]:
        lay = self.layout
        return [lay.lease(worker_id), lay.worker(worker_id), lay.families(worker_id)]

    def changes_for(self, worker_id: WorkerId) -> Changes:
        """New changes (see ``PrefixIndex.changes_for``).

        Raises:
            PrefixIndexError: No lease token was given for the worker.
        """
        self._token(worker_id)
        return Changes()

    async def write(self, worker_id: WorkerId, changes: Changes) -> None:
        """Write changes got from :meth:`changes_for` (see ``PrefixIndex.write``).

        Raises:
            StaleLeaseError: This router no longer holds the worker's lease.
            PrefixIndexError: No lease token was given for the worker.
        """
        failed = await self.write_many({worker_id: changes})
        if worker_id in failed:
            raise failed[worker_id]

    async def write_many(self, writes: Mapping[WorkerId, Changes]) -> dict[WorkerId, Exception]:
        """Write several workers' changes in one script call on a single node (see
        ``PrefixIndex.write_many``); returns the failure of each refused worker
        (``StaleLeaseError``, or ``PrefixIndexError`` without a lease token).

        Raises:
            redis.exceptions.RedisError: The write failed (every worker's, as far as
                the caller knows).
        """
        failed: dict[WorkerId, Exception] = {}
        fenced: list[tuple[WorkerId, str, Changes]] = []
        for worker_id, changes in writes.items():
            try:
                fenced.append((worker_id, self._token(worker_id), changes))
            except PrefixIndexError as exc:  # the lease was dropped while queued
                failed[worker_id] = exc
        if self.is_cluster:
            results = await gather_bounded(self._send_cluster(*write) for write in fenced)
            for (worker_id, _, _), result in zip(fenced, results, strict=True):
                if result is not None:
                    failed[worker_id] = result
            return failed
        for keys, args in self._single_node_calls(fenced):
            refused = await _apply_workers(self.client, keys, args)
            for raw in refused:
                worker_id = WorkerId(reply_bytes(raw).decode())
                failed[worker_id] = StaleLeaseError(
                    f"write for worker {worker_id!r} refused: lease not held with this "
                    "epoch; re-acquire the worker's lease and resync it"
                )
        return failed

    def _single_node_calls(
        self, fenced: list[tuple[WorkerId, str, Changes]]
    ) -> list[tuple[list[str], list[Any]]]:
        """``APPLY_WORKERS`` calls (keys, arguments) for the writes, in order.

        A call closes once it holds ``_MAX_WRITE_ARGS`` arguments, between two families
        (a worker's write may then span calls, each fenced): a burst such as a snapshot
        load never makes one script block Redis for long or build a huge ``ARGV``.
        """
        calls: list[tuple[list[str], list[Any]]] = []
        keys: list[str] = []
        args: list[Any] = [self.layout.prefix]
        size = 1  # the arguments args makes (packed keys count one each)
        for worker_id, token, changes in fenced:
            head = -1
            delta = start = 0
            for tag, lists in changes.key_lists():
                if head < 0 or size >= _MAX_WRITE_ARGS:
                    if head >= 0:
                        args[head + 2 : head + 4] = [delta, size - start]
                    if size >= _MAX_WRITE_ARGS:
                        calls.append((keys, args))
                        keys, args, size = [], [self.layout.prefix], 1
                    head, delta = len(args), 0
                    args.extend((token, worker_id, 0, 0))
                    size += 4
                    start = size
                    keys.extend(self._worker_keys(worker_id))
                change, appended = _append_family(tag, lists, args, self._pack)
                delta += change
                size += appended
            if head >= 0:
                args[head + 2 : head + 4] = [delta, size - start]
        if keys:
            calls.append((keys, args))
        return calls

    async def _send_cluster(
        self, worker_id: WorkerId, token: str, changes: Changes
    ) -> Exception | None:
        """Write one worker's changes on a cluster; its failure (not raised), or None."""
        try:
            await self._write_cluster(worker_id, token, changes)
        except Exception as exc:  # reported per worker, as the single-node write does
            return exc
        return None

    async def _write_cluster(self, worker_id: WorkerId, token: str, changes: Changes) -> None:
        delta = 0
        families: list[tuple[BlockKey, list[str | int]]] = []
        for tag, lists in changes.key_lists():
            args: list[str | int] = []
            delta += _append_family(tag, lists, args, None)[0]
            families.append((tag, args))
        tags = [tag_text(tag) for tag, _ in families]
        await _apply_worker(self.client, self._worker_keys(worker_id), [token, delta, *tags])
        groups: dict[int, tuple[str, list[str | int]]] = {}
        prefix = self.layout.prefix
        for tag, args in families:
            holders = self.layout.holders(tag)
            slot = key_slot(holders.encode())
            groups.setdefault(slot, (holders, [worker_id, prefix]))[1].extend(args)
        await gather_bounded(
            _apply_families(self.client, [key], args) for key, args in groups.values()
        )

    async def lookup(
        self, keys: Sequence[BlockKey], workers: Sequence[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatch]:
        """Longest held prefix per candidate, in one round trip (see ``PrefixIndex.lookup``)."""
        if not keys or (workers is not None and not workers):
            return {}
        tag = keys[0]
        fields = [] if workers is None else list(dict.fromkeys(workers))
        reply: list[Any] = await _lookup(
            self.client,
            [self.layout.holders(tag)],
            [self.layout.prefix, tag_text(tag), encode_keys_fixed(keys), *fields],
        )
        out: dict[WorkerId, PrefixMatch] = {}
        for i in range(0, len(reply), 3):
            gpu, cpu = int(reply[i + 1]), int(reply[i + 2])
            out[WorkerId(reply_bytes(reply[i]).decode())] = PrefixMatch(gpu + cpu, gpu, cpu)
        return out

    async def clear_worker(self, worker_id: WorkerId) -> None:
        """Drop every entry of one worker, found through its family list.

        Costs O(its families) in chunks; entries written before a router restart are
        removed too.

        Raises:
            StaleLeaseError: This router no longer holds the worker's lease.
        """
        token = self._token(worker_id)
        worker_keys = self._worker_keys(worker_id)
        # Fenced first: a router that lost the lease stops here (and an empty list resets
        # the entry count).
        await _forget_families(self.client, worker_keys, [token])
        prefix = self.layout.prefix
        while chunk := await self.client.srandmember(self.layout.families(worker_id), _CLEAR_CHUNK):
            tags = [reply_bytes(t).decode() for t in chunk]
            groups: dict[int, tuple[str, list[str]]] = {}
            for tag in tags:
                holders = self.layout.holders(BlockKey(int(tag, 16)))
                slot = key_slot(holders.encode())
                groups.setdefault(slot, (holders, [worker_id, prefix]))[1].append(tag)
            await gather_bounded(
                _clear_families(self.client, [key], args) for key, args in groups.values()
            )
            await _forget_families(self.client, worker_keys, [token, *tags])

    async def worker_entries(self, worker_id: WorkerId) -> dict[BlockKey, int]:
        """Every entry of one worker in Redis: router key -> tier mask (for checks)."""
        lay = self.layout
        out: dict[BlockKey, int] = {}
        async for raw in self.client.sscan_iter(lay.families(worker_id), count=500):
            tag = BlockKey(int(reply_bytes(raw), 16))
            for tier, bit in (("g", GPU_MASK), ("c", CPU_MASK)):
                for member in await self.client.smembers(lay.tier_set(tag, worker_id, tier)):
                    key = decode_key(reply_bytes(member))
                    out[key] = out.get(key, 0) | bit
        return out

    async def stats(self) -> IndexStats:
        """Sizes of the namespace; memory is the servers' ``used_memory``.

        NOTE: ``num_keys`` (distinct router keys over all workers) is computed by reading
        every worker's sets: O(entries), for tools, not for the request path.
        """
        lay = self.layout
        indexed = await self.client.smembers(lay.indexed)
        workers = [WorkerId(reply_bytes(w).decode()) for w in indexed]
        counts = await gather_bounded(self.client.hget(lay.worker(w), "entries") for w in workers)
        entries = [int(c) for c in counts if c is not None]
        keys: set[BlockKey] = set()
        for worker in workers:
            keys.update(await self.worker_entries(worker))
        return IndexStats(
            num_entries=sum(entries),
            num_keys=len(keys),
            num_workers=sum(1 for c in entries if c > 0),
            memory_bytes=await self._used_memory(),
        )

    async def _used_memory(self) -> int:
        if isinstance(self.client, RedisCluster):
            info = await self.client.info("memory", target_nodes=RedisCluster.PRIMARIES)
            return sum(int(node["used_memory"]) for node in info.values())
        return int((await self.client.info("memory"))["used_memory"])
