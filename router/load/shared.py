"""Per-worker load shared by every router replica through Redis, merged with what workers report.

Each replica owns one Redis hash of its own in-flight load per worker (fields
``r:<worker>``, ``p:<worker>``, ``d:<worker>``: requests, queued prefill tokens, decode
tokens), changed with atomic ``HINCRBY`` and kept alive by a heartbeat that rewrites it
whole and renews its expiry. A replica that crashes stops renewing, so its hash expires
after ``ttl_s`` and the load it held disappears instead of leaking forever. Every replica
sums the hashes of the others (refreshed in the background every ``refresh_interval_s``)
with its own exact in-process figures, so two replicas see each other's traffic and do
not herd onto one worker. Who the others are is learned at each heartbeat (every
``ttl_s / 3``), so a replica alone sends Redis nothing between heartbeats.

Workers' own figures (``/health`` of kvroute workers, ``/metrics`` of vLLM engines, polled
by :class:`router.load.reports.WorkerReportPoller`) are merged field by field with
``max``: both the router's count and the worker's report are lower bounds of the truth
(the router misses direct clients, the report is stale).

If Redis is unreachable the tracker keeps serving this replica's local figures and says
so (:attr:`RedisLoadTracker.is_shared`); the next successful heartbeat rewrites its hash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from redis.exceptions import RedisError

from events.identity import WorkerId
from events.rate_limited_log import RateLimitedLog
from router.errors import RouterError
from router.load.model import WorkerLoad
from router.store.connection import RedisClient
from router.store.scripts import ADD_LOAD, REWRITE_HASH, Script
from router.tasks.periodic import Periodic
from router.workers.leases import live_members

__all__ = ["RedisLoadTracker", "SharedLoadConfig"]

logger = logging.getLogger(__name__)

_add_load = Script(ADD_LOAD)
_FIELDS: Final = ("r", "p", "d")  # num_requests, queued_prefill_tokens, decode_tokens
_IDLE: Final = WorkerLoad()
_LOG_INTERVAL_S: Final = 10.0
_REWRITE: Final = Script(REWRITE_HASH)


@dataclass(frozen=True, slots=True)
class SharedLoadConfig:
    """Configuration of the Redis-shared load tracker.

    Attributes:
        namespace: Key namespace (``kvroute:<namespace>:load:...``), shared by the replicas
            of one cluster.
        replica_id: This replica's identity; ``None`` picks a random one.
        ttl_s: Lifetime of a replica's hash without heartbeat: a crashed replica's load
            is forgotten within this time.
        refresh_interval_s: How often the other replicas' load is re-read; the most a
            decision's view of them can lag.
    """

    namespace: str = "default"
    replica_id: str | None = None
    ttl_s: float = 10.0
    refresh_interval_s: float = 0.05

    def __post_init__(self) -> None:
        if not self.ttl_s > 0 or not self.refresh_interval_s > 0:
            raise RouterError(
                f"shared load ttl_s and refresh_interval_s must be > 0, got "
                f"{self.ttl_s} and {self.refresh_interval_s}"
            )


class RedisLoadTracker:
    """A :class:`router.load.model.LoadTracker` shared by router replicas through Redis.

    Args:
        client: An asyncio Redis client (``decode_responses=False``); use a short
            ``socket_timeout`` so an unreachable Redis fails fast.
        config: Namespace, replica id, TTL and refresh interval.

    NOTE: ``_local`` is this replica's exact load (clamped at 0, as
    :class:`router.load.model.MemoryLoadTracker` does) and always wins over what Redis holds
    for it; ``_remote`` is the sum over the other live replicas as of the last refresh;
    ``_reported`` holds the workers' own figures. A snapshot is
    ``max(_local + _remote, _reported)`` per field.
    """

    def __init__(self, client: RedisClient, config: SharedLoadConfig | None = None) -> None:
        self.config = config or SharedLoadConfig()
        self.replica_id = self.config.replica_id or uuid.uuid4().hex[:12]
        self._client = client
        base = f"kvroute:{self.config.namespace}:load:{{{self.config.namespace}}}"
        self._replicas_key = f"{base}:replicas"
        self._own_key = f"{base}:r:{self.replica_id}"
        self._base = base
        self._local: dict[WorkerId, WorkerLoad] = {}
        self._pending: set[asyncio.Task[bool]] = set()
        # NOTE: _unsent holds increments already in _local whose write task has been
        # scheduled but has not started; it is empty whenever no such task is pending.
        self._unsent: dict[WorkerId, WorkerLoad] = {}
        self._remote: dict[WorkerId, WorkerLoad] = {}
        # NOTE: the other live replicas as of this replica's last heartbeat (a replica
        # that joined since is read from the next one on, within ttl_s / 3).
        self._others: list[str] = []
        self._reported: dict[WorkerId, WorkerLoad] = {}
        self._is_shared = False
        # Each retry of a failing Redis (down, or out of memory) fails again: say so at
        # most once per interval, not once per retry.
        self._warn = RateLimitedLog(_LOG_INTERVAL_S, logger)
        self._next_heartbeat = 0.0
        self._loop = Periodic(self._tick, self.config.refresh_interval_s)
        self.num_errors = 0
        """Redis operations that failed (each also logged)."""

    @property
    def is_shared(self) -> bool:
        """True while Redis answers, i.e. load is shared with the other replicas."""
        return self._is_shared

    async def start(self) -> None:
        """Publish this replica's (empty) load and start the refresh loop."""
        await self._sync()
        self._loop.start(f"shared-load-{self.replica_id}")

    async def close(self) -> None:
        """Stop the loop and withdraw this replica's load from Redis (best effort)."""
        await self._loop.stop()
        if self._pending:
            await asyncio.wait(list(self._pending))
        with contextlib.suppress(RedisError, OSError):
            await self._client.delete(self._own_key)
            await self._client.zrem(self._replicas_key, self.replica_id)

    async def add(self, worker_id: WorkerId, delta: WorkerLoad) -> None:
        """Add ``delta`` to this replica's load on a worker, locally and in Redis."""
        self._add_local(worker_id, delta)
        if self._is_shared:  # else the next heartbeat rewrites the hash once Redis is back
            await self._publish({worker_id: delta})

    def add_nowait(self, worker_id: WorkerId, delta: WorkerLoad) -> None:
        """:meth:`add` without waiting for Redis: the local figures change at once.

        For the request path: the increment reaches the other replicas a round trip later
        without delaying the request. Increments made before the write task runs are
        coalesced into one pipeline (``close`` waits for the writes in flight).
        """
        self._add_local(worker_id, delta)
        if not self._is_shared:
            return
        queued = self._unsent.get(worker_id)
        self._unsent[worker_id] = delta if queued is None else queued + delta
        if len(self._unsent) == 1 and queued is None:  # first of a batch: schedule its write
            task = asyncio.create_task(self._publish_unsent())
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def _add_local(self, worker_id: WorkerId, delta: WorkerLoad) -> None:
        load = (self._local.get(worker_id, _IDLE) + delta).clamped()
        if load == _IDLE:  # idle workers are absent: busy() walks the busy ones only
            self._local.pop(worker_id, None)
        else:
            self._local[worker_id] = load

    async def _publish_unsent(self) -> bool:
        deltas, self._unsent = self._unsent, {}
        return await self._publish(deltas)

    async def _publish(self, deltas: Mapping[WorkerId, WorkerLoad]) -> bool:
        # One script call, not a pipeline of HINCRBYs: a request's increments cost one
        # command to pack and one reply to parse (bench_router, proxied rows).
        args: list[str | int] = [int(self.config.ttl_s * 1000)]
        for worker_id, delta in deltas.items():
            for name, value in zip(_FIELDS, _values(delta), strict=True):
                if value:
                    args += (f"{name}:{worker_id}", value)
        return await self._guard(_add_load(self._client, [self._own_key], args), "add")

    async def snapshot(self, workers: Iterable[WorkerId]) -> Mapping[WorkerId, WorkerLoad]:
        """Each worker's load over all replicas, merged with what it reports itself."""
        return {w: self._load_of(w) for w in workers}

    def busy(self, candidates: Container[WorkerId]) -> dict[WorkerId, WorkerLoad]:
        """:meth:`snapshot` of the ``candidates`` that are not idle (the others: idle).

        Costs O(busy workers), whatever the number of candidates.
        """
        busy = self._local.keys() | self._remote.keys() | self._reported.keys()
        return {w: self._load_of(w) for w in busy if w in candidates}

    def _load_of(self, worker_id: WorkerId) -> WorkerLoad:
        routed = self._local.get(worker_id, _IDLE)
        other = self._remote.get(worker_id)
        if other is not None:
            routed = routed + other
        own = self._reported.get(worker_id)
        if own is None:
            return routed
        # Reports are clamped, so the idle case needs no new object.
        return own if routed is _IDLE else _field_max(routed, own)

    async def forget(self, worker_id: WorkerId) -> None:
        """Drop a worker's load on this replica (it left or restarted)."""
        self._local.pop(worker_id, None)
        self._remote.pop(worker_id, None)
        self._reported.pop(worker_id, None)
        if self._is_shared:
            fields = [f"{name}:{worker_id}" for name in _FIELDS]
            await self._guard(self._client.hdel(self._own_key, *fields), "forget")

    def report(self, worker_id: WorkerId, load: WorkerLoad | None) -> None:
        """Record the load a worker reports itself (``None``: it reports nothing)."""
        if load is None:
            self._reported.pop(worker_id, None)
        else:
            clamped = load.clamped()
            if clamped == _IDLE:  # idle workers are absent: busy() walks the busy ones only
                self._reported.pop(worker_id, None)
            else:
                self._reported[worker_id] = clamped

    async def refresh(self) -> None:
        """Heartbeat when due, learn who the other replicas are and re-read their load now."""
        await self._tick(membership=True)

    async def _tick(self, *, membership: bool = False) -> None:
        """The loop's step: heartbeat when due (which learns the other replicas), then
        re-read their load (``membership``: learn who they are first)."""
        if time.monotonic() >= self._next_heartbeat:
            await self._sync()
        elif membership and self._is_shared:
            await self._guard(self._read_members(), "refresh")
        if self._is_shared:
            await self._guard(self._read_remote(), "refresh")

    async def _read_members(self) -> None:
        ttl_ms = int(self.config.ttl_s * 1000)
        self._learn(await live_members(self._client, self._replicas_key, "", ttl_ms))

    def _learn(self, live: list[str]) -> None:
        self._others = [rid for rid in live if rid != self.replica_id]

    async def _sync(self) -> None:
        """Rewrite this replica's hash from the local figures and renew its lease."""
        ttl_ms = int(self.config.ttl_s * 1000)
        self._unsent.clear()  # the rewrite below includes them (they are in _local)
        pairs: list[str | int] = [ttl_ms]
        for w, load in self._local.items():
            for name, value in zip(_FIELDS, _values(load), strict=True):
                if value:
                    pairs += (f"{name}:{w}", value)

        async def write() -> None:
            # One script on one key, no MULTI: a cluster client runs it on the event loop
            # like any command (its transactions take a helper thread and loop).
            await _REWRITE(self._client, [self._own_key], pairs)
            key, me = self._replicas_key, self.replica_id
            self._learn(await live_members(self._client, key, me, ttl_ms))

        was_shared = self._is_shared
        self._is_shared = True
        if await self._guard(write(), "heartbeat"):
            self._next_heartbeat = time.monotonic() + self.config.ttl_s / 3
            if not was_shared:
                logger.info(
                    "shared load: Redis reachable, replica %s shares its load", self.replica_id
                )

    async def _read_remote(self) -> None:
        others = self._others
        if not others:
            self._remote = {}
            return  # alone: nothing to read (the next heartbeat says who joined)
        pipe = self._client.pipeline(transaction=False)
        for rid in others:
            pipe.hgetall(f"{self._base}:r:{rid}")
        hashes: list[dict[bytes, bytes]] = await pipe.execute()
        totals: dict[WorkerId, list[int]] = {}
        for fields in hashes:
            for raw_field, raw_value in fields.items():
                name, _, worker = raw_field.decode().partition(":")
                if name in _FIELDS and worker:
                    slot = totals.setdefault(WorkerId(worker), [0, 0, 0])
                    slot[_FIELDS.index(name)] += int(raw_value)
        remote = {w: WorkerLoad(*v).clamped() for w, v in totals.items()}
        self._remote = {w: load for w, load in remote.items() if load != _IDLE}

    async def _guard(self, op: Any, what: str) -> bool:
        """Await a Redis operation; on failure count it, log it and stop sharing."""
        try:
            await op
        except (RedisError, OSError) as exc:
            self.num_errors += 1
            if self._is_shared:
                self._warn.warning(
                    ("shared_load", what),
                    "shared load: Redis %s failed (%s); using local load only",
                    what,
                    exc,
                )
            self._is_shared = False
            self._remote = {}
            # Retry soon, but not at every refresh: an outage is logged once, not flooded.
            self._next_heartbeat = time.monotonic() + min(1.0, self.config.ttl_s / 3)
            return False
        return True


def _values(load: WorkerLoad) -> tuple[int, int, int]:
    return (load.num_requests, load.queued_prefill_tokens, load.decode_tokens)


def _field_max(a: WorkerLoad, b: WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        max(a.num_requests, b.num_requests),
        max(a.queued_prefill_tokens, b.queued_prefill_tokens),
        max(a.decode_tokens, b.decode_tokens),
    )
