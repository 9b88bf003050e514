"""The registration client of a worker, against an HTTP server on loopback that answers as told.

Exactly which answers are asked again (5xx, 408, 429, no connection) and which stop the
worker (any other 4xx, with the router's own message), what is sent (the body, the key),
and that a stop ends the asking.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from events.auth import SentKey
from pool.worker.router_registration import RegistrationRefusedError, RouterRegistration
from tests.support.polling import eventually

BODY = {"worker_id": "w/0", "url": "http://10.0.0.5:8100", "events": "tcp://10.0.0.5:5557"}


@asynccontextmanager
async def router_answering(
    answers: list[tuple[int, dict[str, Any]]],
) -> AsyncIterator[tuple[str, list[tuple[str, str, str | None, Any]]]]:
    """A server answering each request with the next of ``answers`` (then 200); yields its
    URL and what it received: ``(method, path, Authorization, JSON body)``."""
    seen: list[tuple[str, str, str | None, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        seen.append((request.method, request.raw_path, request.headers.get("Authorization"), body))
        status, answer = answers.pop(0) if answers else (200, {"removed": "w/0"})
        return web.json_response(answer, status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/", seen
    finally:
        await runner.cleanup()


def error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "unavailable"}}


def test_busy_answers_are_asked_again_until_the_router_takes_it() -> None:
    async def scenario() -> None:
        answers = [(503, error("Redis failed")), (429, error("slow down")), (201, {})]
        async with router_answering(answers) as (url, seen):
            registration = RouterRegistration(url, BODY, SentKey("k3y", "test"))
            assert await registration.register(asyncio.Event()) is True
            await registration.deregister()
        path = "/v1/workers/w%2F0"
        assert seen == [
            ("PUT", path, "Bearer k3y", BODY),
            ("PUT", path, "Bearer k3y", BODY),
            ("PUT", path, "Bearer k3y", BODY),
            ("DELETE", path, "Bearer k3y", None),
        ]

    asyncio.run(scenario())


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_a_refusal_stops_with_the_routers_message(status: int) -> None:
    async def scenario() -> None:
        async with router_answering([(status, error("invalid worker: no"))]) as (url, seen):
            with pytest.raises(RegistrationRefusedError) as info:
                await RouterRegistration(url, BODY).register(asyncio.Event())
        assert str(info.value) == (
            f"the router at {url}v1/workers/w%2F0 refused this worker ({status}): "
            "invalid worker: no"
        )
        assert [s[2] for s in seen] == [None]  # no key given: none sent

    asyncio.run(scenario())


def test_a_stop_ends_the_asking_and_an_unreachable_router_is_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "kvroute.worker.registration")

    def said(start: str) -> bool:
        return any(r.getMessage().startswith(start) for r in caplog.records)

    async def scenario() -> None:
        async with router_answering([]) as (url, _):
            pass  # closed: nothing listens there any more
        stop = asyncio.Event()
        # A long delay between attempts: only the stop can end it within the bound.
        registration = RouterRegistration(url, BODY, max_delay_s=3600)
        asking = asyncio.ensure_future(registration.register(stop))
        await eventually(lambda: said("cannot register with the router at"), "a failed try")
        stop.set()
        assert await asyncio.wait_for(asking, 30) is False
        await RouterRegistration(url, BODY, timeout_s=5).deregister()  # logged, not raised
        assert said(f"deregistered from the router at {url}v1/workers/w%2F0 (failed: ")

    asyncio.run(scenario())
