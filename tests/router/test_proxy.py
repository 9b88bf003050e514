"""Forwarding to workers over real HTTP: pass-through, streams, retries on the next best."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from router.chat import ChatRewriter
from router.index.base import WorkerId
from router.proxy import (
    AttemptOutcome,
    ProxyConfig,
    ProxyTarget,
    ResponseRewriter,
    WorkerProxy,
    WorkersUnavailableError,
)
from router.redis_server import free_port

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "cached_tokens": 3}


class Recorder:
    """An AttemptObserver that writes down every call in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str] | tuple[str, str, str]] = []

    async def attempt_started(self, target: ProxyTarget) -> None:
        self.calls.append(("start", target.worker_id))

    async def first_byte(self, target: ProxyTarget) -> None:
        self.calls.append(("first_byte", target.worker_id))

    async def attempt_ended(self, target: ProxyTarget, outcome: AttemptOutcome) -> None:
        self.calls.append(("end", target.worker_id, outcome))


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[str]:
    """A real aiohttp worker on a loopback port answering POST /v1/completions."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def echo(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response(
        {
            "object": "text_completion",
            "choices": [{"index": 0, "text": "ok:" + body["prompt"], "finish_reason": "length"}],
            "usage": _USAGE,
        }
    )


async def sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    for text in ("a", "b"):
        await resp.write(f'data: {{"choices": [{{"index": 0, "text": "{text}"}}]}}\n\n'.encode())
    last = {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}], "usage": _USAGE}
    await resp.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
    await resp.write_eof()
    return resp


def status(code: int, kind: str | None = None) -> Handler:
    """A worker answering every request with ``code`` and a JSON error (of type ``kind``)."""
    error: dict[str, str] = {"message": f"status {code}"}
    if kind is not None:
        error["type"] = kind

    async def handler(_: web.Request) -> web.Response:
        return web.json_response({"error": error}, status=code)

    return handler


async def hang_up(request: web.Request) -> web.Response:
    """A worker that dies mid-request: the connection closes without an answer."""
    await request.read()
    assert request.transport is not None
    request.transport.close()
    return web.Response()  # goes nowhere: the transport is closed


async def run_proxy(
    targets: list[ProxyTarget],
    body: dict[str, object],
    rewriter_factory: Callable[[], ResponseRewriter] | None = None,
    config: ProxyConfig | None = None,
) -> tuple[int, dict[str, str], bytes, Recorder, list[object]]:
    """Put a WorkerProxy behind a real front server and send it one client request."""
    recorder = Recorder()
    results: list[object] = []

    async with aiohttp.ClientSession() as upstream:
        proxy = WorkerProxy(upstream, config or ProxyConfig(connect_timeout_s=5))

        async def front(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            rewriter = rewriter_factory() if rewriter_factory else None
            try:
                response, result = await proxy.forward(
                    request, "/v1/completions", raw, targets, recorder, rewriter
                )
            except WorkersUnavailableError as exc:
                results.append(exc)
                return web.json_response({"error": str(exc)}, status=502)
            results.append(result)
            return response

        async with (
            serve(front) as url,
            aiohttp.ClientSession() as client,
            client.post(f"{url}/v1/completions", json=body) as resp,
        ):
            return resp.status, dict(resp.headers), await resp.read(), recorder, results


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def test_passes_answer_through_and_names_the_worker() -> None:
    async def scenario() -> None:
        async with serve(echo) as url:
            code, headers, body, rec, results = await run_proxy(
                [ProxyTarget(WorkerId("w1"), url)], {"prompt": "hi", "extra": [1, 2]}
            )
        assert code == 200
        assert headers["X-Kvroute-Worker"] == "w1"
        assert json.loads(body)["choices"][0]["text"] == "ok:hi"
        assert rec.calls == [("start", "w1"), ("first_byte", "w1"), ("end", "w1", "ok")]
        (result,) = results
        assert result.worker_id == "w1" and result.num_attempts == 1  # type: ignore[attr-defined]
        assert result.usage == _USAGE  # type: ignore[attr-defined]

    asyncio.run(scenario())


@pytest.mark.parametrize("failure", ["refused", "503", "hang_up"])
def test_retries_on_the_next_best_when_the_chosen_worker_fails(failure: str) -> None:
    async def scenario() -> None:
        async with (
            serve(echo) as good,
            serve(status(503, "draining")) as busy,
            serve(hang_up) as dying,
        ):
            bad = {"refused": _dead_url(), "503": busy, "hang_up": dying}[failure]
            targets = [ProxyTarget(WorkerId("bad"), bad), ProxyTarget(WorkerId("good"), good)]
            code, headers, body, rec, results = await run_proxy(targets, {"prompt": "x"})
        assert code == 200
        assert headers["X-Kvroute-Worker"] == "good"
        assert json.loads(body)["choices"][0]["text"] == "ok:x"
        assert rec.calls == [
            ("start", "bad"),
            *([("end", "bad", "failed")]),
            ("start", "good"),
            ("first_byte", "good"),
            ("end", "good", "ok"),
        ]
        (result,) = results
        assert result.num_attempts == 2  # type: ignore[attr-defined]
        assert len(result.failures) == 1 and result.failures[0].startswith("bad: ")  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_client_errors_of_a_worker_are_its_answer_not_a_failure() -> None:
    async def scenario() -> None:
        async with serve(status(400)) as picky, serve(echo) as good:
            targets = [ProxyTarget(WorkerId("picky"), picky), ProxyTarget(WorkerId("good"), good)]
            code, headers, body, rec, _ = await run_proxy(targets, {"prompt": "x"})
        assert code == 400
        assert headers["X-Kvroute-Worker"] == "picky"
        assert json.loads(body) == {"error": {"message": "status 400"}}
        assert rec.calls == [("start", "picky"), ("first_byte", "picky"), ("end", "picky", "ok")]

    asyncio.run(scenario())


def test_every_worker_failing_is_reported_with_each_reason() -> None:
    async def scenario() -> None:
        async with serve(status(503, "overloaded")) as busy:
            targets = [
                ProxyTarget(WorkerId("a"), _dead_url()),
                ProxyTarget(WorkerId("b"), busy),
                ProxyTarget(WorkerId("c"), _dead_url()),
            ]
            code, _, _, rec, results = await run_proxy(
                targets, {"prompt": "x"}, config=ProxyConfig(max_attempts=2)
            )
        assert code == 502
        (exc,) = results
        assert isinstance(exc, WorkersUnavailableError)
        assert [f.split(":")[0] for f in exc.failures] == ["a", "b"]  # max_attempts=2
        assert "HTTP 503 (not taken)" in exc.failures[1]
        assert rec.calls == [
            ("start", "a"),
            ("end", "a", "failed"),
            ("start", "b"),
            ("end", "b", "failed"),
        ]

    asyncio.run(scenario())


def test_streams_pass_through_event_by_event() -> None:
    async def scenario() -> None:
        async with serve(sse) as url:
            code, headers, body, rec, results = await run_proxy(
                [ProxyTarget(WorkerId("s"), url)], {"prompt": "x", "stream": True}
            )
        assert code == 200
        assert headers["Content-Type"].startswith("text/event-stream")
        assert headers["X-Kvroute-Worker"] == "s"
        events = [line for line in body.decode().split("\n") if line]
        assert events[0] == 'data: {"choices": [{"index": 0, "text": "a"}]}'
        assert events[1] == 'data: {"choices": [{"index": 0, "text": "b"}]}'
        assert events[-1] == "data: [DONE]"
        assert len(events) == 4
        assert results[0].usage == _USAGE  # type: ignore[attr-defined]
        assert rec.calls == [("start", "s"), ("first_byte", "s"), ("end", "s", "ok")]

    asyncio.run(scenario())


def test_chat_rewriter_reshapes_buffered_and_streamed_answers() -> None:
    async def scenario() -> None:
        async with serve(echo) as buffered, serve(sse) as streamed:
            _, _, body, _, _ = await run_proxy(
                [ProxyTarget(WorkerId("b"), buffered)], {"prompt": "q"}, ChatRewriter
            )
            _, _, stream, _, _ = await run_proxy(
                [ProxyTarget(WorkerId("s"), streamed)],
                {"prompt": "q", "stream": True},
                ChatRewriter,
            )
        chat = json.loads(body)
        assert chat["object"] == "chat.completion"
        assert chat["choices"] == [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok:q"},
                "finish_reason": "length",
            }
        ]
        assert chat["usage"] == _USAGE
        chunks = [line[6:] for line in stream.decode().split("\n") if line.startswith("data: ")]
        assert chunks[-1] == "[DONE]"
        parsed = [json.loads(c) for c in chunks[:-1]]
        assert [p["object"] for p in parsed] == ["chat.completion.chunk"] * 3
        assert [p["choices"][0]["delta"] for p in parsed] == [
            {"content": "a", "role": "assistant"},
            {"content": "b"},
            {"content": ""},
        ]
        assert parsed[-1]["choices"][0]["finish_reason"] == "stop"

    asyncio.run(scenario())


def test_a_client_leaving_mid_stream_ends_the_attempt_and_the_worker_stream() -> None:
    stopped = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        try:
            for i in range(10_000):
                await resp.write(f'data: {{"choices": [{{"text": "{i}"}}]}}\n\n'.encode())
                await asyncio.sleep(0.01)  # a slow token stream
        except ConnectionResetError:
            stopped.set()  # the router closed its side
        return resp

    async def scenario() -> None:
        recorder = Recorder()
        async with aiohttp.ClientSession() as upstream, serve(endless) as worker_url:
            proxy = WorkerProxy(upstream)
            done = asyncio.Event()

            async def front(request: web.Request) -> web.StreamResponse:
                target = ProxyTarget(WorkerId("s"), worker_url)
                try:
                    response, _ = await proxy.forward(
                        request, "/v1/completions", await request.read(), [target], recorder
                    )
                finally:
                    done.set()
                return response

            async with serve(front) as url, aiohttp.ClientSession() as client:
                resp = await client.post(f"{url}/v1/completions", json={"stream": True})
                first = await resp.content.readline()
                assert first.startswith(b"data: ")
                resp.close()  # the client leaves
                await asyncio.wait_for(done.wait(), 30)
                await asyncio.wait_for(stopped.wait(), 30)
        assert recorder.calls == [("start", "s"), ("first_byte", "s"), ("end", "s", "aborted")]

    asyncio.run(scenario())
