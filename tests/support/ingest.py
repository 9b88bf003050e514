"""An ingest under test: fake workers (real publisher + snapshot HTTP), an ingest stack.

Shared by the ingest, routing and CLI tests: :class:`FakeWorker` and :class:`LifetimeWorker`
(which also answers ``GET /health`` with its publisher lifetime id), :class:`Stack` (one
router replica's ingest), the prompts' events and keys, and reads of a router service's
counters.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

import aiohttp
from aiohttp import web

from events.endpoints import Endpoint
from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.publisher import EventPublisher, PublisherConfig
from events.schema import BlockRemoved, BlockStored, KVEventBatch
from pool.snapshot import CachedChains, new_lifetime_id
from router.cli.index import check_workers
from router.front.service import RouterService
from router.index.base import PrefixMatch
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.ingest.config import IngestConfig
from router.ingest.metrics import IngestMetrics
from router.ingest.service import IndexIngest
from router.store.connection import RedisClient, connect
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRecord, WorkerRegistry
from tests.support.polling import eventually

BS = 4
BLOCKS_PER_PROMPT = 12
KEYER = RouterKeyer()


def tokens(prompt: int) -> list[int]:
    """The token ids of a prompt (distinct per prompt from block 0)."""
    return [prompt * 10_000 + i for i in range(BLOCKS_PER_PROMPT * BS)]


def block_hash(prompt: int, block: int) -> int:
    """A worker-side engine hash of block ``block`` of ``prompt``."""
    return prompt * 1_000 + block + 1


def keys(prompt: int) -> list[Any]:
    return KEYER.keys(tokens(prompt), BS)


def stored(
    prompt: int, first: int, count: int, *, medium: str = "GPU", bad_tokens: bool = False
) -> BlockStored:
    """Blocks ``first .. first+count-1`` of ``prompt`` (``bad_tokens``: one token short)."""
    toks = tokens(prompt)[first * BS : (first + count) * BS]
    return BlockStored(
        block_hashes=[block_hash(prompt, b) for b in range(first, first + count)],
        parent_block_hash=None if first == 0 else block_hash(prompt, first - 1),
        token_ids=toks[:-1] if bad_tokens else toks,
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(prompt: int, *blocks: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[block_hash(prompt, b) for b in blocks], medium="GPU")


def match(num_blocks: int) -> PrefixMatch:
    return PrefixMatch(num_blocks, num_blocks, 0)


class FakeWorker:
    """A worker's event side: a real EventPublisher, a CachedChains tracker, /v1/snapshot.

    Args:
        worker_id: Its id.
        kind: ``"kvroute"`` serves ``/v1/snapshot``; ``"vllm"`` only publishes.
        replay: Open a replay endpoint.
        skip_live_seqs: Seqs buffered for replay but never sent live (loss injection).
        buffer_steps: Batches its replay endpoint keeps (a vLLM engine's ring reaches
            back only so far).
    """

    def __init__(
        self,
        worker_id: str,
        *,
        kind: Literal["kvroute", "vllm"] = "kvroute",
        replay: bool = True,
        skip_live_seqs: set[int] | None = None,
        buffer_steps: int = 10_000,
    ) -> None:
        self.worker_id = worker_id
        self.buffer_steps = buffer_steps
        self.kind = kind
        self.chains = CachedChains(BS)
        self.skip_live_seqs = skip_live_seqs if skip_live_seqs is not None else set()
        self.hide_snapshot = False  # serve an empty snapshot (a buggy worker)
        # NOTE: while set, GET /v1/snapshot hangs until release_snapshot() (or close()).
        self.hold_snapshot = False
        self.snapshot_requests = 0
        self._snapshot_released = asyncio.Event()
        self.last_batch: KVEventBatch | None = None
        self.publisher = self._new_publisher(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*" if replay else None
        )
        self._runner: web.AppRunner | None = None
        self.http_url: str | None = None

    def _new_publisher(self, address: str, replay_address: str | None) -> EventPublisher:
        return EventPublisher(
            PublisherConfig(
                endpoint=Endpoint.binding(address),
                replay_endpoint=Endpoint.binding(replay_address) if replay_address else None,
                buffer_steps=self.buffer_steps,
            ),
            skip_live_seqs=self.skip_live_seqs,
        )

    async def start(self) -> FakeWorker:
        if self.kind == "kvroute":
            app = web.Application()
            app.router.add_get("/v1/snapshot", self._snapshot)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.http_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def _snapshot(self, _: web.Request) -> web.Response:
        self.snapshot_requests += 1
        if self.hold_snapshot:
            await self._snapshot_released.wait()
        runs = [] if self.hide_snapshot else self.chains.runs()
        body = {
            "worker_id": self.worker_id,
            "block_size": BS,
            "hash_algo": "test",
            "medium": "GPU",
            "next_seq": self.publisher.next_seq,
            "runs": runs,
        }
        return web.json_response(body)

    def publish(self, *events: BlockStored | BlockRemoved) -> int:
        """Publish one batch (none: an empty probe batch); returns its seq."""
        seq = self.publisher.next_seq
        self.chains.apply(events)
        self.last_batch = KVEventBatch(ts=time.time(), events=list(events))
        assert self.publisher.publish(self.last_batch)
        return seq

    def restart_publisher(self) -> None:
        """A new publisher lifetime on the same addresses (seq restarts at 0, cache empty)."""
        address, replay_address = self.publisher.address, self.publisher.replay_address
        self.publisher.close()
        self.chains = CachedChains(BS)
        self.publisher = self._new_publisher(address, replay_address)

    def release_snapshot(self) -> None:
        """Let the held snapshot requests (and later ones) be answered."""
        self.hold_snapshot = False
        self._snapshot_released.set()

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.worker_id,
            events_endpoint=self.publisher.address,
            replay_endpoint=self.publisher.replay_address,
            http_url=self.http_url,
            kind=self.kind,
            block_size=BS,
        )

    async def close(self) -> None:
        self.release_snapshot()  # or the server's cleanup waits for the held handlers
        self.publisher.close()
        if self._runner is not None:
            await self._runner.cleanup()


@asynccontextmanager
async def fake_workers(*workers: FakeWorker) -> AsyncIterator[tuple[FakeWorker, ...]]:
    try:
        for worker in workers:
            await worker.start()
        yield workers
    finally:
        for worker in workers:
            await worker.close()


class Stack:
    """One router replica's ingest: Redis client, index, registry, ingest (``config``:
    more :class:`IngestConfig` settings)."""

    def __init__(
        self,
        client: RedisClient,
        namespace: str,
        *,
        lease_ttl_ms: int = 5_000,
        maintain_interval_s: float = 0.2,
        owner: str | None = None,
        **config: Any,
    ) -> None:
        layout = KeyLayout(namespace)
        self.client = client
        self.index = BridgedIndex(RedisPrefixIndex(client, layout))
        self.registry = WorkerRegistry(client, layout, owner=owner, lease_ttl_ms=lease_ttl_ms)
        self.metrics = IngestMetrics()
        self.ingest = IndexIngest(
            self.index,
            self.registry,
            IngestConfig(maintain_interval_s=maintain_interval_s, **config),
            self.metrics,
        )

    async def handshake(self, *workers: FakeWorker) -> None:
        """Publish empty batches until the ingest took one more from each worker than it
        had (its stream is up: a subscription's first batches can be lost, slow joiner)."""
        for worker in workers:
            wid = worker.worker_id
            before = self._taken(wid)

            async def seen(worker: FakeWorker = worker, before: float = before) -> bool:
                if self._taken(worker.worker_id) > before:
                    return True
                worker.publish()
                return False

            await eventually(seen, what=f"handshake with {wid}")

    def _taken(self, worker_id: str) -> float:
        """Batches of the worker applied or found covered so far."""
        return self.count("batches", worker=worker_id, outcome="applied") + self.count(
            "batches", worker=worker_id, outcome="covered"
        )

    def count(self, name: str, **labels: str) -> float:
        """A counter's value (0 when never incremented)."""
        value = self.metrics.registry.get_sample_value(f"kvroute_ingest_{name}_total", labels)
        return 0.0 if value is None else value

    def total(self, name: str, **labels: str) -> float:
        """A counter's sum over the label values not given (e.g. every reason)."""
        return sum(
            sample.value
            for family in self.metrics.registry.collect()
            for sample in family.samples
            if sample.name == f"kvroute_ingest_{name}_total"
            and labels.items() <= sample.labels.items()
        )


@asynccontextmanager
async def stack(
    url: str, namespace: str, records: list[WorkerRecord] | None = None, **kwargs: Any
) -> AsyncIterator[Stack]:
    client = await connect(url)
    s = Stack(client, namespace, **kwargs)
    try:
        if records is not None:
            await s.ingest.start(records)
        yield s
    finally:
        await s.ingest.close()
        await client.aclose()


async def divergent(index: BridgedIndex, *workers: FakeWorker) -> int:
    """Entries by which the index differs from the workers' snapshots (``kvroute index check``)."""
    async with aiohttp.ClientSession() as session:
        targets = [(w.worker_id, w.http_url or "") for w in workers]
        checks = await check_workers(index.store, index.keyer, session, targets)
        return sum(c.num_divergent for c in checks)


def lookup_is(
    index: BridgedIndex, prompt: int, expected: dict[str, PrefixMatch]
) -> Callable[[], Awaitable[bool]]:
    """A predicate: the index's lookup of ``prompt`` equals ``expected`` (worker -> match)."""

    async def check() -> bool:
        return dict(await index.lookup(keys(prompt))) == {
            WorkerId(w): m for w, m in expected.items()
        }

    return check


BY_HAND = {"maintain_interval_s": 3600.0, "lease_ttl_ms": 600_000}
"""No maintenance pass after the start: its lifetime check would find a restart first."""


class LifetimeWorker(FakeWorker):
    """A :class:`FakeWorker` that also serves ``GET /health`` with its lifetime id.

    Args:
        worker_id: Its id.
        health: ``"ok"`` answers with the id; ``"silent"`` never answers.
        kwargs: As for :class:`FakeWorker`.
    """

    def __init__(
        self, worker_id: str, *, health: Literal["ok", "silent"] = "ok", **kwargs: Any
    ) -> None:
        super().__init__(worker_id, **kwargs)
        self.lifetime_id = new_lifetime_id()
        self.health = health
        self._released = asyncio.Event()

    async def start(self) -> LifetimeWorker:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/snapshot", self._snapshot)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.http_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def _health(self, _: web.Request) -> web.Response:
        if self.health == "silent":
            await self._released.wait()  # the client times out first; close() releases
        return web.json_response(
            {
                "status": "ok",
                "worker_id": self.worker_id,
                "lifetime_id": self.lifetime_id,
                "next_seq": self.publisher.next_seq,
            }
        )

    def restart_publisher(self) -> None:
        super().restart_publisher()
        self.lifetime_id = new_lifetime_id()

    async def close(self) -> None:
        self._released.set()  # or the server's cleanup waits for the silent handlers
        await super().close()


def stream_count(s: Stack, name: str, worker: str) -> float:
    """A ``kvroute_stream_*`` counter of the subscriber (0 when never incremented)."""
    value = s.metrics.registry.get_sample_value(f"kvroute_stream_{name}_total", {"worker": worker})
    return 0.0 if value is None else value


def sample(svc: RouterService, name: str, **labels: str) -> float:
    """A sample of the router service's metrics (0 when never set)."""
    value = svc.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def streams_up(svc: RouterService, *workers: FakeWorker) -> None:
    """Publish empty batches until the ingest applied one of each worker (slow joiner)."""
    for worker in workers:

        async def applied(worker: FakeWorker = worker) -> bool:
            labels = {"worker": worker.worker_id, "outcome": "applied"}
            if sample(svc, "kvroute_ingest_batches_total", **labels) > 0:
                return True
            worker.publish()
            return False

        await eventually(applied, what=f"{worker.worker_id}'s stream")
