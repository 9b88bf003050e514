"""Single-writer leases on workers' index entries, with epoch fencing and holders' liveness.

* A lease (``SET`` with ``PX``, value ``"<epoch>:<owner>"``) makes one router the only
  writer of a worker's index entries; every index write checks the token server-side,
  so a router holding an old epoch cannot write (fencing).
* A lease lasts while its holder is alive: a holder whose liveness lapsed (one lease
  TTL without :meth:`WorkerLeases.hold`, which routers renew with their heartbeat)
  holds nothing, and any router may take its leases (:meth:`WorkerLeases.acquire`
  with the live holders). The key itself expires only
  after :data:`LEASE_KEY_TTLS` TTLs, a backstop renewed every third of that, all of a
  router's due leases in one round trip (:meth:`WorkerLeases.renew_all`): a router
  with 1,000 workers renews 1,000 keys every 20 s (default TTL), not every 3 s. Any
  router replica's :meth:`WorkerLeases.reap` removes the entries of a worker whose
  lease lapsed or whose holder is gone, when no router ingests it.
* Router replicas share the ingest: each renews a heartbeat (:meth:`WorkerLeases.heartbeat`)
  and :func:`owner_of` assigns every worker to one live replica by rendezvous hashing, so
  N replicas ingest about 1/N of the workers each and a change of membership moves only
  the workers of the replica that joined or left.

The registrations themselves are :class:`router.workers.registry.WorkerRegistry`'s, which
adds them to these leases.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Final

import xxhash

from events.identity import WorkerId
from router.index.base import PrefixIndex
from router.store.connection import RedisClient, reply_bytes
from router.store.layout import KeyLayout
from router.store.scripts import ACQUIRE, HAND_OFF, HEARTBEAT, RELEASE, Script

__all__ = ["LEASE_KEY_TTLS", "Lease", "WorkerLeases", "live_members", "owner_of"]

log = logging.getLogger(__name__)

_acquire = Script(ACQUIRE)
_release = Script(RELEASE)
_hand_off = Script(HAND_OFF)
_heartbeat = Script(HEARTBEAT)

LEASE_KEY_TTLS: Final = 6
"""A lease key's lifetime, in lease TTLs: the holder's heartbeat decides, the key's expiry
only cleans up after routers that are gone."""


def owner_of(worker_id: WorkerId, routers: Sequence[str]) -> str | None:
    """The live router that should ingest a worker (rendezvous hashing), or None if none.

    Every replica computes the same answer from the same membership; when a router joins
    or leaves, only the workers it wins or held change owner.
    """
    if not routers:
        return None
    weight = xxhash.xxh3_64_intdigest
    return max(routers, key=lambda router: weight(f"{router}\0{worker_id}".encode()))


async def live_members(client: RedisClient, key: str, member: str, ttl_ms: int) -> list[str]:
    """Renew ``member``'s heartbeat in the sorted set ``key`` for ``ttl_ms`` (``""``: only
    read) and return the live members, sorted.

    Heartbeats are scored by the Redis server's clock, so members' clocks never need to
    agree; lapsed members are dropped on every call.
    """
    live = await _heartbeat(client, [key], [member, ttl_ms])
    return sorted(reply_bytes(r).decode() for r in live)


@dataclass(frozen=True, slots=True)
class Lease:
    """A held lease: the right to write one worker's entries.

    Attributes:
        worker_id: The worker.
        epoch: Incremented on every acquisition; writes with an older one are refused.
        owner: The router instance that holds it.
    """

    worker_id: WorkerId
    epoch: int
    owner: str

    @property
    def token(self) -> str:
        """What the lease key holds and every fenced write must present."""
        return f"{self.epoch}:{self.owner}"


class WorkerLeases:
    """The leases of a namespace's workers, and the liveness of routers and lease holders.

    Args:
        client: A connected Redis client.
        layout: Key names of the namespace.
        owner: This router instance's id (random by default).
        lease_ttl_ms: Lease lifetime; renew well within it (e.g. every third).
    """

    def __init__(
        self,
        client: RedisClient,
        layout: KeyLayout | None = None,
        *,
        owner: str | None = None,
        lease_ttl_ms: int = 10_000,
    ) -> None:
        self.client = client
        self.layout = layout if layout is not None else KeyLayout()
        self.owner = owner if owner is not None else uuid.uuid4().hex[:16]
        self.lease_ttl_ms = lease_ttl_ms
        self.lease_key_ttl_ms = LEASE_KEY_TTLS * lease_ttl_ms
        # A restarting router may take longer than a lease TTL to come back for the state
        # it handed itself; the epoch check still tells whether anyone came in between.
        self.handoff_ttl_ms = 6 * lease_ttl_ms

    async def acquire(self, worker_id: WorkerId, live: Sequence[str] = ()) -> Lease | None:
        """Take the worker's lease with a new epoch, unless another owner holds it: one of
        the ``live`` holders (none given: any owner, until its key expires)."""
        lay = self.layout
        epoch = await _acquire(
            self.client,
            [lay.lease(worker_id), lay.worker(worker_id)],
            [self.owner, self.lease_key_ttl_ms, *live],
        )
        if epoch is None:
            return None
        await self.client.sadd(lay.indexed, worker_id)
        return Lease(worker_id, int(epoch), self.owner)

    async def renew(self, lease: Lease) -> bool:
        """Extend a held lease; False when it lapsed or was taken (stop writing then)."""
        return (await self.renew_all([lease]))[0]

    async def renew_all(self, leases: Sequence[Lease]) -> list[bool]:
        """Extend held leases in one round trip (one ``GETEX`` each, pipelined without a
        transaction: it works across cluster shards); per lease, False when it lapsed or
        was taken (stop writing then).

        NOTE: ``GETEX`` extends whatever the key holds: a lease another router took in
        between is extended by one TTL too, harmlessly (its holder renews it anyway), and
        this router learns from the value that it lost it.
        """
        if not leases:
            return []
        pipe = self.client.pipeline(transaction=False)
        for lease in leases:
            pipe.getex(self.layout.lease(lease.worker_id), px=self.lease_key_ttl_ms)
        values = await pipe.execute()
        return [
            value is not None and reply_bytes(value).decode() == lease.token
            for lease, value in zip(leases, values, strict=True)
        ]

    async def release(self, lease: Lease) -> None:
        """Give a lease up now (its entries stay until reaped or cleared)."""
        await _release(self.client, [self.layout.lease(lease.worker_id)], [lease.token])

    async def hand_off(self, lease: Lease, next_owner: str, state: bytes) -> bool:
        """Pass a held lease to ``next_owner`` with this router's ``state`` of the worker.

        The lease stays taken in the next owner's name (``""``: parked, free for any
        router) until it is acquired, or for one TTL, so the worker is not reaped in
        between; ``state`` is kept for :attr:`handoff_ttl_ms`. False when this router no
        longer held the lease.
        """
        lay = self.layout
        done = await _hand_off(
            self.client,
            [lay.lease(lease.worker_id), lay.handoff(lease.worker_id)],
            [lease.token, next_owner, self.lease_ttl_ms, self.handoff_ttl_ms, state],
        )
        return bool(done)

    async def take_handoff(self, worker_id: WorkerId) -> bytes | None:
        """Remove and return the state handed over with the worker's lease (None: none).

        Call it right after :meth:`acquire`; whether the state is still valid is for the
        caller to check against the acquired epoch (:mod:`router.ingest.handoff`).
        """
        state = await self.client.getdel(self.layout.handoff(worker_id))
        return None if state is None else reply_bytes(state)

    async def heartbeat(self) -> list[str]:
        """Renew this router's membership for one lease TTL; returns the live routers."""
        return await self._routers(self.owner)

    async def hold(self) -> list[str]:
        """Renew this owner's liveness as a lease holder for one lease TTL (routers at
        every heartbeat; a tool that takes leases once, for as long as its leases last);
        returns the live holders. A lease whose holder is not among them may be taken
        (:meth:`acquire` with them)."""
        lay = self.layout
        return await live_members(self.client, lay.lease_holders, self.owner, self.lease_ttl_ms)

    async def live_routers(self) -> list[str]:
        """The live routers, without joining them (for tools)."""
        return await self._routers("")

    async def _routers(self, joining: str) -> list[str]:
        return await live_members(self.client, self.layout.routers, joining, self.lease_ttl_ms)

    async def leave(self) -> None:
        """Withdraw this router's membership (on shutdown), so others take its workers."""
        await self.client.zrem(self.layout.routers, self.owner)
        await self.client.zrem(self.layout.lease_holders, self.owner)

    async def holder(self, worker_id: WorkerId) -> str | None:
        """The current lease token of a worker, or None when nobody holds it."""
        value = await self.client.get(self.layout.lease(worker_id))
        return None if value is None else reply_bytes(value).decode()

    async def _held_by_live(self, worker_id: WorkerId, live: Sequence[str]) -> bool:
        """Whether someone holds the worker's lease: a live holder (``live`` empty: anyone
        whose key has not expired), or nobody in particular (parked for any router)."""
        token = await self.holder(worker_id)
        if token is None:
            return False
        holder = token.partition(":")[2]
        return not live or holder == "" or holder in live

    async def reap(
        self,
        index: PrefixIndex,
        ingested: Collection[WorkerId] = (),
        live: Sequence[str] = (),
    ) -> list[WorkerId]:
        """Remove the entries of every worker whose lease lapsed, or whose holder is not
        among the ``live`` holders (none given: only lapsed keys count); returns those
        workers.

        Any router replica may run it: it takes the lease itself (a new epoch, so the
        previous holder can no longer write), clears the worker and releases it.
        ``ingested``: workers the caller ingests (their owner among the live routers
        takes them over instead): not checked, so a router costs one command per pass
        here, not one per worker.
        """
        lay = self.layout
        reaped: list[WorkerId] = []
        for raw in await self.client.smembers(lay.indexed):
            worker_id = WorkerId(reply_bytes(raw).decode())
            if worker_id in ingested or await self._held_by_live(worker_id, live):
                continue
            lease = await self.acquire(worker_id, live)
            if lease is None:
                continue
            index.use_lease(worker_id, lease.token)
            try:
                await index.clear_worker(worker_id)
                await self.client.srem(lay.indexed, worker_id)
            finally:
                index.forget_lease(worker_id)
                await self.release(lease)
            log.warning("reaped worker %r: its lease lapsed, its entries were removed", worker_id)
            reaped.append(worker_id)
        return reaped
