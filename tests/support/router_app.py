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
    """A stand-in worker: echoes prompts (recording them, the raw bodies by path and the
    request headers, header names lowercased), answers chats and streams (usage on a last
    chunk only when asked, as OpenAI does), lists ``models`` at ``GET /v1/models`` (404
    when ``None``), reports load, serves an empty snapshot."""

    worker_id: str
    prompts: list[Any] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[tuple[str, bytes]] = field(default_factory=list)
    models: list[str] | None = None
    url: str = ""

    async def _record(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        self.bodies.append((request.path, raw))
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        body: dict[str, Any] = json.loads(raw)
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        self.prompts.append(body["prompt"])
        text = f"{self.worker_id}:{len(self.prompts)}"
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        if body.get("stream"):
            return await self._stream(request, body, choice)
        return web.json_response(
            {
                "id": f"cmpl-{self.worker_id}",
                "object": "text_completion",
                "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0},
            }
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        message = {"role": "assistant", "content": f"{self.worker_id}:chat"}
        return web.json_response(
            {
                "id": f"chatcmpl-{self.worker_id}",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0},
            }
        )

    async def _stream(
        self, request: web.Request, body: dict[str, Any], choice: dict[str, Any]
    ) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        with_usage = (body.get("stream_options") or {}).get("include_usage") is True
        chunk: dict[str, Any] = {"object": "text_completion", "choices": [choice]}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}
        chunks = [chunk] + ([{"object": "text_completion", "choices": [], "usage": usage}]
                            if with_usage else [])  # fmt: skip
        for c in chunks:
            await resp.write(f"data: {json.dumps(c)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def list_models(self, _: web.Request) -> web.Response:
        if self.models is None:
            return web.json_response({"error": {"message": "no"}}, status=404)
        data = [{"id": m, "object": "model", "owned_by": self.worker_id} for m in self.models]
        return web.json_response({"object": "list", "data": data})

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
    workers = [kind(f"w{i}") for i in range(n)]
    runners = []
    for w in workers:
        app = web.Application()
        app.router.add_post("/v1/completions", w.completions)
        app.router.add_post("/v1/chat/completions", w.chat)
        app.router.add_get("/v1/models", w.list_models)
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


def run(
    redis_url: str,
    namespace: str,
    scenario: Scenario,
    n: int = 2,
    kind: type[EchoWorker] = EchoWorker,
    **overrides: Any,
) -> None:
    """Run ``scenario`` against a router over ``n`` echo workers of ``kind``
    (``overrides``: RouterConfig)."""

    async def main() -> None:
        async with (
            echo_workers(n, kind) as workers,
            running_router(redis_url, namespace, workers, **overrides) as (svc, client),
        ):
            await scenario(svc, client, workers)

    asyncio.run(main())


async def saved_ids(svc: RouterService) -> list[str]:
    """Worker ids of the registrations saved in Redis (usable or not)."""
    raw = await svc.registry.client.hkeys(svc.registry.layout.registry)
    return sorted(k.decode() for k in raw)
