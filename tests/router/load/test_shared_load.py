"""Load shared by router replicas through Redis: sums, expiry of crashed replicas, outages."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from aiohttp import ClientSession, web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.identity import WorkerId
from router.load.model import WorkerLoad, finished, routed
from router.load.reports import (
    WorkerReportPoller,
    parse_health_load,
    parse_vllm_metrics_load,
)
from router.load.shared import RedisLoadTracker, SharedLoadConfig
from router.store.connection import connect
from router.store.server import RedisServer
from tests.support.polling import eventually

W1, W2 = WorkerId("w1"), WorkerId("w2")
BOUND_S = 15.0
"""Longest wait for a write or an expiry to show in another replica's view."""


def _client(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)


def test_replicas_see_each_others_load(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        cfg = SharedLoadConfig(namespace=namespace)
        a = RedisLoadTracker(_client(redis_url), SharedLoadConfig(namespace, "a"))
        b = RedisLoadTracker(_client(redis_url), SharedLoadConfig(namespace, "b"))
        await a.start()
        await b.start()
        try:
            await a.add(W1, routed(100, 10))
            await a.add(W1, routed(50, 5))
            await b.add(W1, routed(7, 1))
            await b.add(W2, routed(3, 2))
            await a.refresh()
            await b.refresh()
            expected = {W1: WorkerLoad(3, 157, 16), W2: WorkerLoad(1, 3, 2)}
            assert await a.snapshot([W1, W2]) == expected
            assert await b.snapshot([W1, W2]) == expected
            await a.add(W1, finished(10))
            await b.refresh()
            assert (await b.snapshot([W1]))[W1] == WorkerLoad(2, 157, 6)
            assert a.is_shared and b.is_shared and cfg.namespace == namespace
        finally:
            await a.close()
            await b.close()
        # A closed replica withdraws its load at once.
        c = RedisLoadTracker(_client(redis_url), SharedLoadConfig(namespace, "c"))
        await c.start()
        await c.refresh()
        assert await c.snapshot([W1, W2]) == {W1: WorkerLoad(), W2: WorkerLoad()}
        await c.close()

    asyncio.run(scenario())


def test_add_nowait_changes_local_load_at_once_and_reaches_redis(
    redis_url: str, namespace: str
) -> None:
    async def scenario() -> None:
        a = RedisLoadTracker(_client(redis_url), SharedLoadConfig(namespace, "a"))
        b = RedisLoadTracker(_client(redis_url), SharedLoadConfig(namespace, "b"))
        await a.start()
        await b.start()
        a.add_nowait(W1, routed(40, 4))
        assert (await a.snapshot([W1]))[W1] == WorkerLoad(1, 40, 4)  # before any await
        a.add_nowait(W2, routed(7, 1))  # coalesced with the first into one write
        a.add_nowait(W2, finished(1))

        async def b_sees_it() -> bool:
            await b.refresh()
            return await b.snapshot([W1, W2]) == {W1: WorkerLoad(1, 40, 4), W2: WorkerLoad(0, 7, 0)}

        await eventually(b_sees_it, "b to see the coalesced write", timeout_s=BOUND_S)
        a.add_nowait(W1, finished(4))
        await a.close()  # waits for the increment in flight, then withdraws
        await b.refresh()
        assert await b.snapshot([W1, W2]) == {W1: WorkerLoad(), W2: WorkerLoad()}
        await b.close()

    asyncio.run(scenario())


def test_a_replica_with_a_skewed_clock_is_still_seen(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Liveness is judged by the Redis server's clock: a replica whose own clock is an hour
    behind (its heartbeat would read as long lapsed) still shares its load."""

    async def scenario() -> None:
        behind = RedisLoadTracker(_client(redis_url), SharedLoadConfig(namespace, "behind"))
        other = RedisLoadTracker(_client(redis_url), SharedLoadConfig(namespace, "other"))
        real_time = time.time
        with monkeypatch.context() as skewed:
            skewed.setattr(time, "time", lambda: real_time() - 3600)
            await behind.start()
            await behind.add(W1, routed(64, 8))
        await other.start()
        try:
            await other.refresh()
            assert (await other.snapshot([W1]))[W1] == WorkerLoad(1, 64, 8)
        finally:
            await behind.close()
            await other.close()

    asyncio.run(scenario())


@pytest.mark.slow
def test_crashed_replica_load_expires(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        crashed = RedisLoadTracker(_client(redis_url), SharedLoadConfig(namespace, "x", ttl_s=0.6))
        alive = RedisLoadTracker(_client(redis_url), SharedLoadConfig(namespace, "y", ttl_s=0.6))
        await crashed.start()
        await alive.start()
        await crashed.add(W1, routed(64, 8))
        await alive.refresh()
        assert (await alive.snapshot([W1]))[W1] == WorkerLoad(1, 64, 8)
        # A crash: the heartbeat stops, nothing is withdrawn.
        await crashed._loop.stop()
        started = time.monotonic()

        async def gone() -> bool:
            await alive.refresh()
            return (await alive.snapshot([W1]))[W1] == WorkerLoad()

        await eventually(gone, "the crashed replica's load to expire", timeout_s=BOUND_S)
        assert time.monotonic() - started < 5.0
        await alive.close()

    asyncio.run(scenario())


@pytest.mark.slow
def test_redis_outage_keeps_local_load_and_recovers(private_redis: RedisServer) -> None:
    async def scenario() -> None:
        a = RedisLoadTracker(_client(private_redis.url), SharedLoadConfig("ns", "a"))
        await a.start()
        await a.add(W1, routed(10, 1))
        private_redis.stop()
        await a.add(W1, routed(20, 2))  # fails over to local figures, no exception
        assert not a.is_shared
        assert a.num_errors >= 1
        assert (await a.snapshot([W1]))[W1] == WorkerLoad(2, 30, 3)
        await a.add(W2, routed(5, 5))
        await a.refresh()
        assert not a.is_shared
        private_redis.start()  # same port, empty
        await eventually(lambda: _refreshed(a), "a to share its load again", timeout_s=BOUND_S)
        b = RedisLoadTracker(_client(private_redis.url), SharedLoadConfig("ns", "b"))
        await b.start()
        await b.refresh()
        assert await b.snapshot([W1, W2]) == {W1: WorkerLoad(2, 30, 3), W2: WorkerLoad(1, 5, 5)}
        await a.close()
        await b.close()

    asyncio.run(scenario())


async def _refreshed(tracker: RedisLoadTracker) -> bool:
    await tracker.refresh()
    return tracker.is_shared


_deltas = st.lists(
    st.tuples(
        st.sampled_from([0, 1]), st.sampled_from([W1, W2]), st.integers(0, 500), st.integers(0, 50)
    ),
    max_size=12,
)


@pytest.mark.slow
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_deltas)
def test_shared_view_is_the_sum_of_replicas(
    redis_url: str, ops: list[tuple[int, WorkerId, int, int]]
) -> None:
    """Any routed/finished sequence over two replicas: both see the sum of their loads."""

    async def scenario() -> None:
        ns = f"prop-{time.monotonic_ns()}"
        replicas = [RedisLoadTracker(_client(redis_url), SharedLoadConfig(ns, n)) for n in "ab"]
        for r in replicas:
            await r.start()
        truth = [dict.fromkeys((W1, W2), WorkerLoad()) for _ in replicas]
        for which, worker, prefill, decode in ops:
            replica = replicas[which]
            await replica.add(worker, routed(prefill, decode))
            truth[which][worker] = truth[which][worker] + routed(prefill, decode)
            if prefill % 2:  # finish some of them again, without waiting for Redis
                replica.add_nowait(worker, finished(decode))
                truth[which][worker] = truth[which][worker] + finished(decode)
        expected = {w: truth[0][w] + truth[1][w] for w in (W1, W2)}

        async def all_agree() -> bool:
            for r in replicas:
                await r.refresh()
            return all([await r.snapshot([W1, W2]) == expected for r in replicas])

        await eventually(all_agree, "both replicas to see the sum", timeout_s=BOUND_S)
        for r in replicas:
            await r.close()

    asyncio.run(scenario())


def test_worker_reports_merge_with_max() -> None:
    async def scenario() -> None:
        tracker = RedisLoadTracker(_client("redis://127.0.0.1:1/0"), SharedLoadConfig("n", "a"))
        await tracker.add(W1, routed(100, 10))
        tracker.report(W1, WorkerLoad(5, 20, 0))
        tracker.report(W2, WorkerLoad(2))
        assert await tracker.snapshot([W1, W2]) == {W1: WorkerLoad(5, 100, 10), W2: WorkerLoad(2)}
        tracker.report(W1, None)
        assert (await tracker.snapshot([W1]))[W1] == WorkerLoad(1, 100, 10)

    asyncio.run(scenario())


def test_parse_reports() -> None:
    assert parse_health_load({"status": "ok", "running": 3, "waiting": 2}) == WorkerLoad(5)
    assert parse_health_load({"load": {"num_running": 1, "decode_tokens": 9}}) == WorkerLoad(
        1, 0, 9
    )
    assert parse_health_load({"status": "ok"}) is None
    assert parse_health_load(["running", 3]) is None
    assert parse_health_load({"running": "3"}) is None
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 3.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 4.0\n'
    )
    assert parse_vllm_metrics_load(text) == WorkerLoad(7)
    assert parse_vllm_metrics_load("# TYPE other gauge\nother 1.0\n") is None


def test_poller_reads_health_and_vllm_metrics() -> None:
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "load": {"running": 2, "waiting": 1}})

    async def vllm_health(_: web.Request) -> web.Response:
        return web.Response(text="")  # vLLM's /health is an empty 200

    async def vllm_metrics(_: web.Request) -> web.Response:
        return web.Response(
            text="# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 6.0\n"
        )

    async def scenario() -> None:
        runners = []
        urls = []
        for routes in (
            [web.get("/health", health)],
            [web.get("/health", vllm_health), web.get("/metrics", vllm_metrics)],
        ):
            app = web.Application()
            app.add_routes(routes)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")
        tracker = RedisLoadTracker(_client("redis://127.0.0.1:1/0"), SharedLoadConfig("n", "a"))
        async with ClientSession() as session:
            poller = WorkerReportPoller(tracker, session, timeout_s=5.0)
            poller.set_worker(W1, urls[0])
            poller.set_worker(W2, urls[1])
            poller.set_worker(WorkerId("gone"), "http://127.0.0.1:1")
            await poller.poll_once()
            snap = await tracker.snapshot([W1, W2, WorkerId("gone")])
            assert snap == {W1: WorkerLoad(3), W2: WorkerLoad(6), WorkerId("gone"): WorkerLoad()}
            poller.set_worker(W1, None)
            assert (await tracker.snapshot([W1]))[W1] == WorkerLoad()
        for runner in runners:
            await runner.cleanup()

    asyncio.run(scenario())


@pytest.mark.slow
def test_replicas_share_load_on_a_redis_cluster(redis_cluster_url: str) -> None:
    async def scenario() -> None:
        clients = [await connect(redis_cluster_url) for _ in range(2)]
        a = RedisLoadTracker(clients[0], SharedLoadConfig("cluster-ns", "a"))
        b = RedisLoadTracker(clients[1], SharedLoadConfig("cluster-ns", "b"))
        await a.start()
        await b.start()
        await a.add(W1, routed(30, 3))
        await b.add(W2, routed(5, 1))
        await a.refresh()
        await b.refresh()
        expected = {W1: WorkerLoad(1, 30, 3), W2: WorkerLoad(1, 5, 1)}
        assert await a.snapshot([W1, W2]) == expected
        assert await b.snapshot([W1, W2]) == expected
        assert a.is_shared and b.is_shared
        await a.close()
        await b.refresh()
        assert await b.snapshot([W1, W2]) == {W1: WorkerLoad(), W2: WorkerLoad(1, 5, 1)}
        await b.close()
        for client in clients:
            await client.aclose()

    asyncio.run(scenario())
