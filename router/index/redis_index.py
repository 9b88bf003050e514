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
one ``EVALSHA`` on a single node, for any number of workers (group commit sends every
worker's pending changes together, each fenced by its own lease; a burst is split between
families every ``_MAX_WRITE_ARGS`` arguments); on a cluster, per
worker, one call to the worker's shard (fencing + bookkeeping) followed by one call per
family shard, all sent concurrently.

NOTE: on a cluster the fencing check and the family writes are separate scripts, so a
writer whose lease lapses between the two may write that one batch after a newer owner
cleared the worker; its families were recorded in the worker's family list first, so
the next clear of the worker removes them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from events.schema import KVEventBatch
from router.errors import PrefixIndexError
from router.index.base import IndexStats, PrefixMatch
from router.index.changes import CPU_MASK, GPU_MASK, Changes, KeyLists
from router.index.group_commit import GroupCommit
from router.ingest.bridge import WorkerBridge, fold_batch
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

_Sink = tuple[
    Callable[[Changes], Awaitable[None]], Callable[[], Awaitable[None]], Callable[[], Changes]
]
"""``fold_batch``'s write, clear and into callbacks for one worker."""

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
        keyer: Router key function (its seed must match the one requests use).
        group_commit: ``apply`` queues its writes and returns once the batch is folded;
            queued changes merge while the previous write is in flight and all workers'
            go out in one write (see :mod:`router.index.group_commit`). A failed write is
            raised by the worker's next ``apply`` or ``flush``. Off: ``apply`` returns
            once Redis has the batch.

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
        *,
        group_commit: bool = False,
    ) -> None:
        self.client = client
        self.layout = layout if layout is not None else KeyLayout()
        self.keyer = keyer if keyer is not None else RouterKeyer()
        self.is_cluster = isinstance(client, RedisCluster)
        self.group_commit = group_commit
        self._tokens: dict[WorkerId, str] = {}
        self._bridges: dict[WorkerId, WorkerBridge] = {}
        self._block_sizes: dict[WorkerId, int] = {}
        self._sinks: dict[WorkerId, _Sink] = {}
        self._pack = None if self.is_cluster else arg_packer(client)
        self._queues = GroupCommit(self._send)

    def use_lease(self, worker_id: WorkerId, token: str) -> None:
        """Write the worker's entries under this lease token (``"<epoch>:<owner>"``)."""
        self._tokens[WorkerId(check_name("worker id", worker_id))] = token

    def forget_lease(self, worker_id: WorkerId, *, keep_bridge: bool = False) -> None:
        """Stop writing for the worker and drop its queued writes and (unless
        ``keep_bridge``: for :meth:`rewrite_worker` under a new lease) its bridge."""
        self._tokens.pop(worker_id, None)
        if not keep_bridge:
            self._bridges.pop(worker_id, None)
        self._sinks.pop(worker_id, None)
        self._queues.discard(worker_id)

    def expect_block_size(self, worker_id: WorkerId, block_size: int) -> None:
        """Skip (and count in the worker's bridge) every ``BlockStored`` of the worker
        whose block size is not ``block_size`` (its registered one; 0: any, forgotten)."""
        if block_size:
            self._block_sizes[worker_id] = block_size
        else:
            self._block_sizes.pop(worker_id, None)
        bridge = self._bridges.get(worker_id)
        if bridge is not None:
            bridge.block_size = block_size

    def on_write_error(self, callback: Callable[[WorkerId, Exception], None] | None) -> None:
        """With group commit, report a failed queued write to ``callback`` at once."""
        self._queues.on_error = callback

    async def flush(self, worker_id: WorkerId | None = None) -> None:
        """Wait for the queued writes of a worker (or all) with group commit on.

        Raises:
            StaleLeaseError: A queued write was refused: the lease is lost.
            redis.exceptions.RedisError: A queued write failed.
        """
        await self._queues.flush(worker_id)

    async def close(self) -> None:
        """Stop the group-commit senders (queued writes are dropped)."""
        await self._queues.close()

    def bridge(self, worker_id: WorkerId) -> WorkerBridge:
        """The engine-hash bridge of a worker (created on first use)."""
        found = self._bridges.get(worker_id)
        if found is None:
            block_size = self._block_sizes.get(worker_id, 0)
            found = self._bridges[worker_id] = WorkerBridge(self.keyer, block_size=block_size)
        return found

    def adopt_bridge(self, worker_id: WorkerId, bridge: WorkerBridge) -> None:
        """Make ``bridge`` the worker's (one handed over with its lease, matching the
        worker's entries in Redis)."""
        bridge.block_size = self._block_sizes.get(worker_id, 0)
        self._bridges[worker_id] = bridge

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

    async def apply(self, worker_id: WorkerId, batch: KVEventBatch) -> None:
        """Apply one worker's event batch (see ``PrefixIndex.apply``).

        Raises:
            OrphanParentError: A ``BlockStored`` has an unknown parent.
            StaleLeaseError: This router no longer holds the worker's lease.
            PrefixIndexError: No lease token was given for the worker.
        """
        self._token(worker_id)
        sink = self._sinks.get(worker_id)
        if sink is None:
            sink = self._sinks[worker_id] = self._sink(worker_id)
        await fold_batch(worker_id, self.bridge(worker_id), batch, *sink)

    def _sink(self, worker_id: WorkerId) -> _Sink:
        """What ``fold_batch`` writes the worker's segments with (made once per worker:
        the ingest's hot path allocates no closures per batch)."""
        queues = self._queues

        async def write(changes: Changes) -> None:
            if self.group_commit:  # folded into the worker's queued changes
                queues.send_soon()
                return
            failed = await self._send({worker_id: changes})
            if worker_id in failed:
                raise failed[worker_id]

        async def clear() -> None:
            await self.clear_worker(worker_id)

        def into() -> Changes:  # read with write's test, no await between the two
            return queues.queued(worker_id) if self.group_commit else Changes()

        return write, clear, into

    async def _send(self, writes: dict[WorkerId, Changes]) -> dict[WorkerId, Exception]:
        """Write several workers' changes; returns the failure of each refused worker."""
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

        Costs O(its families) in chunks; entries the bridge does not know (written before
        a router restart) are removed too.

        Raises:
            StaleLeaseError: This router no longer holds the worker's lease.
        """
        token = self._token(worker_id)
        # Queued writes land first (a failure among them is moot: the worker is emptied).
        await self._queues.flush(worker_id, raise_errors=False)
        bridge = self._bridges.get(worker_id)
        if bridge is not None:
            bridge.reset()
        await self._drop_entries(worker_id, token)

    async def rewrite_worker(self, worker_id: WorkerId) -> int:
        """Write one worker's entries again from its bridge, which still holds them all,
        after Redis lost some or all of them (it restarted empty, a shard lost its data).

        What Redis holds of the worker is dropped first (with its queued writes: the
        bridge includes them), so its entries end exactly the bridge's.

        Returns:
            The number of entries written.

        Raises:
            StaleLeaseError: This router no longer holds the worker's lease.
        """
        token = self._token(worker_id)
        self._queues.discard(worker_id)
        await self._drop_entries(worker_id, token)
        changes = Changes()
        entries = self.bridge(worker_id).entries()
        for key, (tag, mask) in entries.items():
            changes.note(tag, key, 0, mask)
        failed = await self._send({worker_id: changes})
        if worker_id in failed:
            raise failed[worker_id]
        return len(entries)

    async def _drop_entries(self, worker_id: WorkerId, token: str) -> None:
        """Drop every entry Redis holds of the worker (fenced by ``token``), through its
        family list, leaving the bridge alone."""
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
        await self._queues.flush(worker_id, raise_errors=False)
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
