"""The worker's readiness and its answers once the engine loop drains or dies, on the real
aiohttp app and the real engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from events.endpoints import Endpoint
from events.publisher import EventPublisher, PublisherConfig
from events.tokenizer import ByteTokenizer
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.worker.engine import Engine
from pool.worker.guards import AccessKeys, guard_middlewares
from pool.worker.http import WorkerHTTP, WorkerInfo
from pool.worker.model import DecoderModel, ModelConfig

TIMEOUT_S = 60.0
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel(ModelConfig(seed=5))


@asynccontextmanager
async def serving(engine: Engine) -> AsyncIterator[tuple[WorkerHTTP, aiohttp.ClientSession]]:
    http = WorkerHTTP(engine, ByteTokenizer(), WorkerInfo("w-life"))
    engine.start()
    port = await http.start("127.0.0.1", 0)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=timeout) as client:
            yield http, client
    finally:
        await asyncio.to_thread(engine.stop, TIMEOUT_S)
        await http.stop()


def _engine(model: DecoderModel, publisher: EventPublisher | None = None) -> Engine:
    kv = KVCacheManager(KVCacheConfig(32, BLOCK_SIZE, enable_kv_cache_events=True))
    return Engine(model, model.make_cache(32, BLOCK_SIZE), kv, event_sink=publisher)


async def get(client: aiohttp.ClientSession, path: str) -> tuple[int, Any]:
    async with client.get(path) as resp:
        return resp.status, await (resp.json() if path != "/metrics" else resp.text())


def test_ready_is_200_then_503_draining_then_503_stopped(model: DecoderModel) -> None:
    engine = _engine(model)

    async def main() -> None:
        async with serving(engine) as (http, client):
            status, body = await get(client, "/ready")
            assert (status, body) == (200, {"status": "ready", "worker_id": "w-life",
                                            "lifetime_id": http.info.lifetime_id})  # fmt: skip
            # Hold the engine thread between two steps, so the drain cannot finish yet.
            release = threading.Event()
            held = engine.call(lambda: release.wait(TIMEOUT_S))
            engine.drain()
            status, body = await get(client, "/ready")
            assert (status, body["status"]) == (503, "draining")
            assert body["reason"] == (
                "the worker is draining: it finishes its requests and takes no new ones"
            )
            async with client.post("/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["type"] == "unavailable"
            release.set()
            assert await asyncio.wrap_future(held) is True
            assert await asyncio.to_thread(engine.join, TIMEOUT_S)
            status, body = await get(client, "/ready")
            assert (status, body["status"]) == (503, "stopped")
            assert body["reason"] == "the engine loop has stopped"
            status, body = await get(client, "/health")
            assert (status, body["status"]) == (503, "stopped")

    asyncio.run(main())


def test_a_dead_engine_loop_turns_health_and_ready_503_and_fails_requests_fast(
    model: DecoderModel,
) -> None:
    """The publisher's thread is gone: the loop dies at its first publish, for good."""
    publisher = EventPublisher(PublisherConfig(endpoint=Endpoint.binding("tcp://127.0.0.1:*")))
    publisher.close()
    engine = _engine(model, publisher)

    async def main() -> None:
        async with serving(engine) as (_, client):
            assert (await get(client, "/ready"))[0] == 200
            body = {"prompt": "hello", "max_tokens": 2}
            async with client.post("/v1/completions", json=body) as resp:
                assert resp.status == 503
                assert await resp.json() == {
                    "error": {
                        "message": "the request was aborted: the engine stopped",
                        "type": "unavailable",
                    }
                }
            assert await asyncio.to_thread(engine.join, TIMEOUT_S)
            status, ready = await get(client, "/ready")
            assert (status, ready["status"]) == (503, "stopped")
            assert ready["reason"].startswith(
                "the engine loop failed: PublisherClosedError: publish() on a closed publisher"
            )
            status, health = await get(client, "/health")
            assert (status, health["status"]) == (503, "stopped")
            async with client.post("/v1/completions", json=body) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["type"] == "unavailable"
            # Calls that need the engine thread fail at once (no 30 s wait for a dead loop).
            async with client.get("/v1/snapshot") as resp:
                assert resp.status == 503
                assert await resp.json() == {
                    "error": {"message": "the engine loop has stopped", "type": "unavailable"}
                }
            status, metrics = await get(client, "/metrics")
            assert status == 200
            assert 'kvroute_worker_request_failures_total{reason="engine_stopped"} 1.0' in metrics

    asyncio.run(main())


@pytest.mark.slow
def test_a_reset_while_requests_hold_blocks_is_a_409_with_an_openai_error(
    model: DecoderModel,
) -> None:
    engine = _engine(model)

    async def main() -> None:
        async with serving(engine) as (_, client):
            body = {"prompt": [1, 2, 3], "max_tokens": 100, "stream": True, "ignore_eos": True}
            async with client.post("/v1/completions", json=body) as stream:
                assert (await stream.content.readline()).startswith(b"data: ")
                # The engine runs its inbox between steps: the request still holds blocks.
                running = await asyncio.wrap_future(engine.call(lambda: engine.stats().num_running))
                assert running == 1
                async with client.post("/v1/reset_prefix_cache") as resp:
                    assert resp.status == 409
                    assert await resp.json() == {
                        "success": False,
                        "error": {
                            "message": "requests are running and hold KV blocks; retry when "
                            "the worker is idle",
                            "type": "conflict",
                        },
                    }
                await stream.read()
            async with client.post("/v1/reset_prefix_cache") as resp:
                assert (resp.status, await resp.json()) == (200, {"success": True})

    asyncio.run(main())


def test_an_unexpected_handler_error_is_a_json_500_and_counted() -> None:
    """The outermost guard catches what no handler expected (here a route that raises)."""
    failures: list[str] = []

    async def broken(request: web.Request) -> web.Response:
        raise KeyError("boom")

    async def main() -> None:
        app = web.Application(
            middlewares=guard_middlewares(AccessKeys(), 1024, failures.append, failures.append)
        )
        app.router.add_get("/broken", broken)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            url = f"http://127.0.0.1:{port}/broken"
            async with aiohttp.ClientSession() as client, client.get(url) as resp:
                assert resp.status == 500
                assert resp.content_type == "application/json"
                error = {"message": "internal error: KeyError: 'boom'", "type": "internal_error"}
                assert await resp.json() == {"error": error}
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert failures == ["handler"]
