"""Worker registry: persistent registrations, leases, epoch fencing, reaping lapsed workers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest

from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.schema import BlockStored, KVEventBatch
from router.errors import PrefixIndexError
from router.index.base import IndexStats, PrefixMatch
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.store.connection import RedisClient, connect
from router.store.layout import KeyLayout
from router.store.scripts import StaleLeaseError
from router.workers.leases import owner_of
from router.workers.registration import RegistrationConflict, RegistrationPolicy
from router.workers.registry import (
    WorkerRecord,
    WorkerRegistry,
    load_records,
    parse_worker_spec,
)
from tests.support.index_env import drop_namespace
from tests.support.polling import eventually

W = WorkerId("w1")
TOKENS = list(range(16))
KEYS = RouterKeyer().keys(TOKENS, 4)


def stored(hashes: list[int], parent: int | None, first_block: int) -> KVEventBatch:
    tokens = TOKENS[first_block * 4 : (first_block + len(hashes)) * 4]
    return KVEventBatch(1.0, [BlockStored(hashes, parent, tokens, 4, None, "GPU", None)])


Body = Callable[[RedisClient, KeyLayout], Awaitable[None]]


@pytest.fixture(params=["redis", pytest.param("cluster", marks=pytest.mark.slow)])
def redis_target(request: pytest.FixtureRequest) -> str:
    fixture = "redis_url" if request.param == "redis" else "redis_cluster_url"
    return str(request.getfixturevalue(fixture))


@asynccontextmanager
async def opened(url: str, namespace: str) -> AsyncIterator[tuple[RedisClient, KeyLayout]]:
    client = await connect(url)
    layout = KeyLayout(namespace)
    try:
        yield client, layout
    finally:
        await drop_namespace(client, layout)
        await client.aclose()


def run(url: str, namespace: str, body: Body) -> None:
    async def main() -> None:
        async with opened(url, namespace) as (client, layout):
            await body(client, layout)

    asyncio.run(main())


async def wait_lapsed(registry: WorkerRegistry, worker: WorkerId, timeout_s: float = 20.0) -> None:
    async def lapsed() -> bool:
        return await registry.holder(worker) is None

    await eventually(lapsed, f"{worker}'s lease to lapse", timeout_s=timeout_s)


def test_lease_is_exclusive_and_epochs_grow(redis_target: str, namespace: str) -> None:
    async def body(client: RedisClient, layout: KeyLayout) -> None:
        a = WorkerRegistry(client, layout, owner="router-a", lease_ttl_ms=60_000)
        b = WorkerRegistry(client, layout, owner="router-b", lease_ttl_ms=60_000)
        lease = await a.acquire(W)
        assert lease is not None and lease.epoch == 1 and lease.token == "1:router-a"
        assert await b.acquire(W) is None
        assert await a.renew(lease)
        again = await a.acquire(W)  # the same owner re-acquires with a new epoch
        assert again is not None and again.epoch == 2
        assert not await a.renew(lease)  # the old epoch is gone
        await a.release(lease)  # releasing a stale token does nothing
        assert await a.holder(W) == "2:router-a"
        await a.release(again)
        assert await a.holder(W) is None
        taken = await b.acquire(W)
        assert taken is not None and taken.epoch == 3

    run(redis_target, namespace, body)


def test_a_handed_off_lease_stays_taken_for_its_next_owner(
    redis_target: str, namespace: str
) -> None:
    async def body(client: RedisClient, layout: KeyLayout) -> None:
        a = WorkerRegistry(client, layout, owner="router-a", lease_ttl_ms=60_000)
        b = WorkerRegistry(client, layout, owner="router-b", lease_ttl_ms=60_000)
        c = WorkerRegistry(client, layout, owner="router-c", lease_ttl_ms=60_000)
        lease = await a.acquire(W)
        assert lease is not None
        assert await a.hand_off(lease, "router-b", b"state of w")
        assert not await a.hand_off(lease, "router-b", b"again")  # no longer a's to give
        assert await a.holder(W) == "1:router-b"  # taken: no reaper clears the worker
        assert await c.acquire(W) is None and await a.acquire(W) is None
        taken = await b.acquire(W)
        assert taken is not None and taken.epoch == 2  # the handoff's epoch + 1
        assert await b.take_handoff(W) == b"state of w"
        assert await b.take_handoff(W) is None  # taken once
        # Parked (no next owner, as on shutdown): any router takes it.
        assert await b.hand_off(taken, "", b"parked")
        assert await a.holder(W) == "2:"
        parked = await c.acquire(W)
        assert parked is not None and parked.epoch == 3
        assert await c.take_handoff(W) == b"parked"

    run(redis_target, namespace, body)


@pytest.mark.slow
def test_stale_epoch_cannot_write(redis_target: str, namespace: str) -> None:
    async def body(client: RedisClient, layout: KeyLayout) -> None:
        a = WorkerRegistry(client, layout, owner="router-a", lease_ttl_ms=300)
        b = WorkerRegistry(client, layout, owner="router-b", lease_ttl_ms=60_000)
        old_index = BridgedIndex(RedisPrefixIndex(client, layout))
        new_index = BridgedIndex(RedisPrefixIndex(client, layout))
        lease_a = await a.acquire(W)
        assert lease_a is not None
        old_index.use_lease(W, lease_a.token)
        await old_index.apply(W, stored([1], None, 0))
        await wait_lapsed(a, W)
        assert not await a.renew(lease_a)
        lease_b = await b.acquire(W)
        assert lease_b is not None and lease_b.epoch == 2
        new_index.use_lease(W, lease_b.token)
        await new_index.clear_worker(W)
        with pytest.raises(StaleLeaseError):
            await old_index.apply(W, stored([2], 1, 1))
        with pytest.raises(StaleLeaseError):
            await old_index.clear_worker(W)
        assert await new_index.lookup(KEYS) == {}
        await new_index.apply(W, stored([1, 2], None, 0))
        assert await new_index.lookup(KEYS) == {W: PrefixMatch(2, 2, 0)}

    run(redis_target, namespace, body)


def test_writing_without_a_lease_is_refused(redis_target: str, namespace: str) -> None:
    async def body(client: RedisClient, layout: KeyLayout) -> None:
        index = BridgedIndex(RedisPrefixIndex(client, layout))
        with pytest.raises(PrefixIndexError, match="no lease"):
            await index.apply(W, stored([1], None, 0))
        index.use_lease(W, "7:nobody")
        with pytest.raises(StaleLeaseError):
            await index.apply(W, stored([1], None, 0))
        assert await index.lookup(KEYS) == {}

    run(redis_target, namespace, body)


@pytest.mark.slow
def test_lapsed_worker_is_reaped_by_another_replica(redis_target: str, namespace: str) -> None:
    async def body(client: RedisClient, layout: KeyLayout) -> None:
        silent = WorkerRegistry(client, layout, owner="router-a", lease_ttl_ms=1500)
        live = WorkerRegistry(client, layout, owner="router-a", lease_ttl_ms=60_000)
        reaper = WorkerRegistry(client, layout, owner="router-b", lease_ttl_ms=60_000)
        index = BridgedIndex(RedisPrefixIndex(client, layout))
        for worker, registry in ((W, silent), (WorkerId("w2"), live)):
            lease = await registry.acquire(worker)
            assert lease is not None
            index.use_lease(worker, lease.token)
            await index.apply(worker, stored([1, 2, 3], None, 0))
        assert await reaper.reap(RedisPrefixIndex(client, layout)) == []
        await wait_lapsed(silent, W)
        assert await reaper.reap(RedisPrefixIndex(client, layout)) == [W]
        assert await index.lookup(KEYS) == {WorkerId("w2"): PrefixMatch(3, 3, 0)}
        stats = await index.stats()
        assert (stats.num_entries, stats.num_keys, stats.num_workers) == (3, 3, 1)
        assert await reaper.holder(W) is None  # released after reaping

    run(redis_target, namespace, body)


def test_registration_persists_across_router_restarts(redis_target: str, namespace: str) -> None:
    record = WorkerRecord(
        worker_id="gpu-0",
        events_endpoint="tcp://127.0.0.1:5557",
        replay_endpoint="tcp://127.0.0.1:5558",
        http_url="http://127.0.0.1:8001",
    )

    async def body(client: RedisClient, layout: KeyLayout) -> None:
        await WorkerRegistry(client, layout).register(record)
        vllm = WorkerRecord(worker_id="vllm-1", events_endpoint="tcp://127.0.0.1:6557", kind="vllm")
        await WorkerRegistry(client, layout).register(vllm)
        restarted = WorkerRegistry(client, layout)
        assert await restarted.records() == [record, vllm]
        assert [r.has_snapshot for r in await restarted.records()] == [True, False]
        assert await restarted.unregister(WorkerId("vllm-1"))
        assert not await restarted.unregister(WorkerId("vllm-1"))
        assert await restarted.records() == [record]

    run(redis_target, namespace, body)


def test_worker_specs_and_config_files(tmp_path: Path) -> None:
    spec = "gpu-0=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,http=http://127.0.0.1:8001"
    record = parse_worker_spec(spec + ",block_size=32")
    assert record == WorkerRecord(
        worker_id="gpu-0",
        events_endpoint="tcp://127.0.0.1:5557",
        replay_endpoint="tcp://127.0.0.1:5558",
        http_url="http://127.0.0.1:8001",
        block_size=32,
    )
    assert parse_worker_spec("v=tcp://h:1,kind=vllm").kind == "vllm"
    for bad in ("nope", "=tcp://h:1", "a{b}=tcp://h:1", "a=tcp://h:1,color=red", "a=x,kind=sglang"):
        with pytest.raises(PrefixIndexError):
            parse_worker_spec(bad)
    path = tmp_path / "workers.json"
    path.write_text(
        '[{"worker_id": "gpu-0", "events_endpoint": "tcp://127.0.0.1:5557",'
        ' "replay_endpoint": "tcp://127.0.0.1:5558", "http_url": "http://127.0.0.1:8001",'
        ' "block_size": 32}]'
    )
    assert load_records(path) == [record]
    path.write_text('[{"worker_id": "gpu-0"}]')
    with pytest.raises(PrefixIndexError):
        load_records(path)
    with pytest.raises(PrefixIndexError):
        load_records(tmp_path / "missing.json")


def test_stats_of_an_empty_namespace(redis_target: str, namespace: str) -> None:
    async def body(client: RedisClient, layout: KeyLayout) -> None:
        stats = await RedisPrefixIndex(client, layout).stats()
        assert (stats.num_entries, stats.num_keys, stats.num_workers) == (0, 0, 0)
        assert stats == IndexStats(0, 0, 0, stats.memory_bytes)

    run(redis_target, namespace, body)


@pytest.mark.slow
def test_router_heartbeats_track_live_replicas(redis_target: str, namespace: str) -> None:
    async def body(client: RedisClient, layout: KeyLayout) -> None:
        a = WorkerRegistry(client, layout, owner="router-a", lease_ttl_ms=60_000)
        b = WorkerRegistry(client, layout, owner="router-b", lease_ttl_ms=300)
        assert await a.heartbeat() == ["router-a"]
        assert await b.heartbeat() == ["router-a", "router-b"]
        deadline = time.monotonic() + 20.0
        while await a.heartbeat() != ["router-a"]:  # b stopped renewing: it lapses
            assert time.monotonic() < deadline, "a silent router never left"
            await asyncio.sleep(0.02)  # polling a TTL expiry with a deadline
        assert await b.heartbeat() == ["router-a", "router-b"]  # back again
        await b.leave()
        assert await a.heartbeat() == ["router-a"]

    run(redis_target, namespace, body)


def test_owner_of_spreads_workers_and_moves_few_on_membership_change() -> None:
    workers = [f"worker-{i:03d}" for i in range(300)]
    two = {w: owner_of(w, ["r0", "r1"]) for w in workers}
    assert owner_of("w", []) is None
    assert {w: owner_of(w, ["r1", "r0"]) for w in workers} == two  # order does not matter
    assert 100 <= sum(1 for o in two.values() if o == "r0") <= 200
    three = {w: owner_of(w, ["r0", "r1", "r2"]) for w in workers}
    moved = [w for w in workers if three[w] != two[w]]
    assert moved and all(three[w] == "r2" for w in moved)  # only to the newcomer
    one = {w: owner_of(w, ["r0"]) for w in workers}
    assert all(one[w] == "r0" for w in workers)
    assert [w for w in workers if two[w] != one[w]] == [w for w in workers if two[w] == "r1"]


def test_worker_specs_are_validated_whole() -> None:
    for bad, message in [
        ("a=garbage", "events endpoint 'garbage': expected tcp://HOST:PORT or ipc://PATH"),
        ("a=tcp://h:1,replay=nope", "replay endpoint 'nope'"),
        ("a=tcp://h:1,http=http://", "url 'http://': the host is empty"),
        ("a=tcp://h:1,http=http://h:99999", "Port out of range"),
        ("a=tcp://h:1,block_size=x", "Expected `int`, got `str`"),
        ("a=tcp://h:1,block_size=100000", "block_size must be 1-4096 tokens"),
        ("a=tcp://*:1", "is a wildcard"),
    ]:
        with pytest.raises(PrefixIndexError) as info:
            parse_worker_spec(bad)
        assert message in str(info.value), bad


def test_saved_registrations_that_are_unusable_are_skipped_and_reported_once(
    redis_target: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    good = WorkerRecord(worker_id="good", events_endpoint="tcp://127.0.0.1:5557")
    saved = {
        "good": msgspec.json.encode(good),
        "garbage": b'{"worker_id": "garbage", "events_endpoint": "garbage"}',
        "port": b'{"worker_id": "port", "events_endpoint": "tcp://h:1", "http_url": "http://h:99999"}',
        "json": b"{not json",
        "alias": msgspec.json.encode(WorkerRecord(worker_id="x", events_endpoint="tcp://h:1")),
    }  # fmt: skip
    problems = {
        "garbage": "events endpoint 'garbage': expected tcp://HOST:PORT or ipc://PATH",
        "port": "url 'http://h:99999': Port out of range",
        "json": "JSON is malformed",
        "alias": "it names another worker id, 'x'",
    }

    async def body(client: RedisClient, layout: KeyLayout) -> None:
        await client.hset(layout.registry, mapping=saved)
        reported: list[None] = []
        registry = WorkerRegistry(client, layout, on_invalid=lambda: reported.append(None))
        caplog.set_level(logging.WARNING, "router.workers.registry")
        for _ in range(3):  # every maintenance pass reads them: reported on the first only
            assert await registry.records() == [good]
        assert len(reported) == 4
        warnings = sorted(r.getMessage() for r in caplog.records)
        assert len(warnings) == 4
        for line, (worker, problem) in zip(warnings, sorted(problems.items()), strict=True):
            assert line.startswith(f"skipping the registration of worker '{worker}' stored")
            assert problem in line
            assert f"PUT /v1/workers/{worker}" in line
        # A different bad value for the same worker is news: reported again.
        await client.hset(layout.registry, "json", b"[]")
        assert await registry.records() == [good]
        assert len(reported) == 5
        # The policy of a router applies to saved registrations too.
        strict = WorkerRegistry(client, layout, policy=RegistrationPolicy(require_curve=True))
        assert await strict.records() == []
        assert await registry.saved("garbage") == (None, problems["garbage"])
        assert await registry.saved("good") == (good, None)
        assert await registry.saved("nobody") == (None, None)

    run(redis_target, namespace, body)


def test_save_creates_keeps_refuses_a_conflict_and_replaces_on_request(
    redis_target: str, namespace: str
) -> None:
    first = WorkerRecord(worker_id="w", events_endpoint="tcp://127.0.0.1:1")
    moved = WorkerRecord(worker_id="w", events_endpoint="tcp://127.0.0.1:2")

    async def body(client: RedisClient, layout: KeyLayout) -> None:
        registry = WorkerRegistry(client, layout)
        assert await registry.save(first) == "created"
        assert await registry.save(first) == "unchanged"
        with pytest.raises(RegistrationConflict) as info:
            await registry.save(moved)
        assert info.value.differences == {
            "events_endpoint": ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
        }
        assert await registry.records() == [first]  # the conflict changed nothing
        assert await registry.save(moved, replace=True) == "replaced"
        assert await registry.records() == [moved]
        # An unusable saved value is a conflict too, until replaced.
        await client.hset(layout.registry, "w", b"{broken")
        with pytest.raises(RegistrationConflict, match="an unusable registration is saved"):
            await registry.save(first)
        assert await registry.save(first, replace=True) == "replaced"
        # Two routers registering different workers under one new id at once: one wins.
        a = WorkerRecord(worker_id="race", events_endpoint="tcp://127.0.0.1:3")
        b = WorkerRecord(worker_id="race", events_endpoint="tcp://127.0.0.1:4")
        outcomes = await asyncio.gather(
            registry.save(a), WorkerRegistry(client, layout).save(b), return_exceptions=True
        )
        assert sorted(type(o).__name__ for o in outcomes) == ["RegistrationConflict", "str"]
        winner = a if outcomes[0] == "created" else b
        assert [r for r in await registry.records() if r.worker_id == "race"] == [winner]

    run(redis_target, namespace, body)
