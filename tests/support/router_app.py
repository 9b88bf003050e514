"""A router service in process in front of echo workers: real Redis, aiohttp and HTTP.

:func:`run` starts ``n`` :class:`EchoWorker` servers and a :class:`RouterService` over
them on loopback ports, then runs a scenario against it with a client session bound to the
router's URL.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Final

import aiohttp
from aiohttp import web

from router.front.config import RouterConfig
from router.front.service import RouterService
from router.workers.registry import WorkerRecord


@dataclass
class EchoWorker:
    """A stand-in kvroute worker: echoes prompts (recording them and the request headers,
    header names lowercased), reports load, serves an empty snapshot."""

    worker_id: str
    prompts: list[Any] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    url: str = ""

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.prompts.append(body["prompt"])
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        text = f"{self.worker_id}:{len(self.prompts)}"
        return web.json_response(
            {
                "object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0},
            }
        )

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "running": 0, "waiting": 0})

    async def snapshot(self, _: web.Request) -> web.Response:
        return web.json_response({"block_size": 16, "runs": [], "next_seq": 0})

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.worker_id,
            # Nobody binds it (a free TCP port could be taken by another process meanwhile).
            events_endpoint=f"ipc://{tempfile.gettempdir()}/kvroute-{uuid.uuid4().hex}",
            http_url=self.url,
        )


@asynccontextmanager
async def echo_workers(
    n: int, kind: type[EchoWorker] = EchoWorker
) -> AsyncIterator[list[EchoWorker]]:
    """``n`` workers of ``kind`` (ids ``w0`` ..) serving on free loopback ports."""
    workers = [kind(f"w{i}") for i in range(n)]
    runners = []
    for w in workers:
        app = web.Application()
        app.router.add_post("/v1/completions", w.completions)
        app.router.add_get("/health", w.health)
        app.router.add_get("/v1/snapshot", w.snapshot)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        w.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        runners.append(runner)
    try:
        yield workers
    finally:
        for runner in runners:
            await runner.cleanup()


@asynccontextmanager
async def running_router(
    redis_url: str, namespace: str, workers: list[EchoWorker], **overrides: Any
) -> AsyncIterator[tuple[RouterService, aiohttp.ClientSession]]:
    """A started router over ``workers`` (``overrides``: RouterConfig fields), a client."""
    config = RouterConfig(
        redis_url=redis_url,
        namespace=namespace,
        port=0,
        workers=tuple(w.record() for w in workers),
    )
    async with (
        await RouterService.open(replace(config, **overrides)) as service,
        aiohttp.ClientSession(base_url=service.url) as client,
    ):
        yield service, client


JSON: Final = {"Content-Type": "application/json"}


async def post(
    client: aiohttp.ClientSession, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """POST ``body`` (JSON-encoded unless bytes); returns the status and the JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with client.post(path, data=data, headers={**JSON, **(headers or {})}) as resp:
        return resp.status, await resp.json()


Scenario = Callable[[RouterService, aiohttp.ClientSession, list[EchoWorker]], Awaitable[None]]
"""What :func:`run` runs: the service, a client bound to its URL, the echo workers."""


def run(redis_url: str, namespace: str, scenario: Scenario, n: int = 2, **overrides: Any) -> None:
    """Run ``scenario`` against a router over ``n`` echo workers (``overrides``: RouterConfig)."""

    async def main() -> None:
        async with (
            echo_workers(n) as workers,
            running_router(redis_url, namespace, workers, **overrides) as (svc, client),
        ):
            await scenario(svc, client, workers)

    asyncio.run(main())


async def saved_ids(svc: RouterService) -> list[str]:
    """Worker ids of the registrations saved in Redis (usable or not)."""
    raw = await svc.registry.client.hkeys(svc.registry.layout.registry)
    return sorted(k.decode() for k in raw)
