"""Load polls at fleet scale: a quiet worker is polled less often, a change brings it back,
the lifetime id in the answer is passed on, and named models are not read."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import redis.asyncio as aioredis
from aiohttp import ClientSession, web

from events.identity import WorkerId
from router.load.reports import WorkerReportPoller
from router.load.shared import RedisLoadTracker, SharedLoadConfig

W = WorkerId("w1")


def test_a_quiet_worker_is_polled_less_often_and_its_lifetime_passed_on(
    redis_url: str, namespace: str
) -> None:
    hits: Counter[str] = Counter()
    state: dict[str, Any] = {"running": 0, "lifetime_id": "life-1"}

    async def health(_: web.Request) -> web.Response:
        hits["/health"] += 1
        return web.json_response({"status": "ok", "waiting": 0, **state})

    async def models(_: web.Request) -> web.Response:
        hits["/v1/models"] += 1
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        heard: list[tuple[WorkerId, str]] = []
        tracker = RedisLoadTracker(aioredis.from_url(redis_url), SharedLoadConfig(namespace))
        try:
            async with ClientSession() as session:
                poller = WorkerReportPoller(
                    tracker, session, interval_s=60.0, max_interval_s=600.0,
                    on_models=lambda *_: None,
                    on_lifetime=lambda w, life: heard.append((w, life)),
                )  # fmt: skip
                poller.set_worker(W, url, models=False)  # its registration names its models
                await poller.poll_once()
                await poller.poll_once()  # not due again within the base interval
                assert hits == {"/health": 1}
                assert heard == [(W, "life-1")]
                await poller.read_models(W)
                assert hits["/v1/models"] == 0
                poller.set_worker(W, url)  # (registered anew) models read, due at once
                await poller.poll_once()
                assert hits == {"/health": 2, "/v1/models": 1}
        finally:
            await runner.cleanup()
            await tracker.close()

    asyncio.run(scenario())
