"""A router never takes a wildcard (a bind address) as where a worker is reached.

Through ``PUT /v1/workers/ID`` it is a 400 in OpenAI's error shape that names the field and
the worker flag that fixes it, and nothing is saved; a registration with a wildcard already
saved in Redis (written by an older router, or by hand) is skipped by a router that starts
on it, with one WARNING and one count, and never listed or routed to.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest
import redis.asyncio

from router.store.layout import KeyLayout
from tests.support.router_app import JSON, running_router, saved_ids

GOOD = {"worker_id": "w-wild", "url": "http://10.0.0.5:8100", "events": "tcp://10.0.0.5:5557"}
WILDCARDS = [
    ({"url": "http://0.0.0.0:8100"}, "url 'http://0.0.0.0:8100': '0.0.0.0' is a wildcard"),
    ({"url": "http://[::]:8100"}, "url 'http://[::]:8100': '::' is a wildcard"),
    ({"events": "tcp://*:5557"}, "events endpoint 'tcp://*:5557': '*' is a wildcard"),
    ({"replay": "tcp://[::]:5558"}, "replay endpoint 'tcp://[::]:5558': '::' is a wildcard"),
]


def test_a_wildcard_address_is_refused_with_an_openai_error_and_nothing_is_saved(
    redis_url: str, namespace: str
) -> None:
    async def scenario() -> None:
        async with running_router(redis_url, namespace, []) as (svc, client):
            for change, message in WILDCARDS:
                body = msgspec.json.encode({**GOOD, **change})
                async with client.put("/v1/workers/w-wild", data=body, headers=JSON) as resp:
                    assert resp.status == 400, change
                    error = (await resp.json())["error"]
                assert error["type"] == "invalid_request_error"
                assert error["message"].startswith(f"invalid worker: {message} (a bind address)")
                assert error["message"].endswith("(kvroute worker --advertise-host)")
            assert await saved_ids(svc) == []

    asyncio.run(scenario())


def test_a_saved_wildcard_registration_is_skipped_logged_once_and_counted(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    saved = {"worker_id": "w-wild", "events_endpoint": "tcp://0.0.0.0:5557"}
    caplog.set_level(logging.WARNING, "router.workers.registry")
    registry = KeyLayout(namespace).registry

    async def scenario() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            await client.hset(registry, "w-wild", msgspec.json.encode(saved))
            async with running_router(redis_url, namespace, []) as (svc, http):
                await svc.maintain_once()  # another pass meets it again: no new report
                async with http.get("/v1/workers") as resp:
                    assert (await resp.json())["workers"] == []
                async with http.get("/metrics") as resp:
                    metrics = await resp.text()
                assert "kvroute_router_invalid_registrations_total 1.0" in metrics
                assert svc.proxied() == []
        finally:
            await client.delete(registry)
            await client.aclose()

    asyncio.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if "w-wild" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("skipping the registration of worker 'w-wild' stored in Redis")
    assert "events endpoint 'tcp://0.0.0.0:5557': '0.0.0.0' is a wildcard" in warnings[0]
