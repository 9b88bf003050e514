"""Forwarding to workers over real HTTP: pass-through, streams, retries only when safe,
a bounded retry budget, circuits, and silent (frozen) workers failed over in seconds."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from events.identity import WorkerId
from router.front.breaker import CircuitBreakers, CircuitState
from router.front.proxy import WorkerProxy
from router.front.proxy_contracts import (
    AttemptOutcome,
    ProxyConfig,
    ProxyResult,
    ProxyTarget,
    ResponseRewriter,
    WorkersUnavailableError,
)
from router.front.stream_usage import UsageStripper
from router.store.server import free_port
from tests.support.polling import eventually

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
async def serve(handler: Handler, health: Handler | None = None) -> AsyncIterator[str]:
    """A real aiohttp worker on a loopback port answering POST /v1/completions (and
    GET /health with ``health``; any other path gets aiohttp's 404)."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    if health is not None:
        app.router.add_get("/health", health)
    runner = web.AppRunner(app, handler_cancellation=True)
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
    content_type: str = "application/json",
    make_proxy: Callable[[aiohttp.ClientSession], WorkerProxy] | None = None,
) -> tuple[int, dict[str, str], bytes, Recorder, list[object]]:
    """Put a WorkerProxy behind a real front server and send it one client request."""
    recorder = Recorder()
    results: list[object] = []

    async with aiohttp.ClientSession() as upstream:
        if make_proxy is not None:
            proxy = make_proxy(upstream)
        else:
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
            client.post(
                f"{url}/v1/completions",
                data=json.dumps(body),
                headers={"Content-Type": content_type},
            ) as resp,
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


def test_workers_get_a_json_body_whatever_type_the_client_named() -> None:
    """curl -d says application/x-www-form-urlencoded; workers take JSON bodies only."""
    seen: list[str | None] = []

    async def strict(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Content-Type"))
        return await echo(request)

    async def scenario() -> None:
        async with serve(strict) as url:
            code, _, body, _, _ = await run_proxy(
                [ProxyTarget(WorkerId("w1"), url)],
                {"prompt": "hi"},
                content_type="application/x-www-form-urlencoded",
            )
        assert code == 200, body
        assert seen == ["application/json"]

    asyncio.run(scenario())


async def retry_later(_: web.Request) -> web.Response:
    """A plain 503 with ``Retry-After``: the worker did not take the request."""
    return web.Response(status=503, text="busy", headers={"Retry-After": "1"})


@pytest.mark.parametrize("failure", ["refused", "503", "503-retry-after", "hang_up"])
def test_retries_on_the_next_best_when_the_chosen_worker_fails(failure: str) -> None:
    async def scenario() -> None:
        async with (
            serve(echo) as good,
            serve(status(503, "draining")) as busy,
            serve(retry_later) as later,
            serve(hang_up) as dying,
        ):
            bad = {"refused": _dead_url(), "503": busy, "503-retry-after": later,
                   "hang_up": dying}[failure]  # fmt: skip
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


async def sse_with_usage_chunk(request: web.Request) -> web.StreamResponse:
    """A stream as OpenAI and vLLM send it with include_usage: usage on its own last chunk."""
    resp = web.StreamResponse()
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    for text in ("a", "b"):
        chunk = {"choices": [{"index": 0, "text": text}], "usage": None}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    last = {"choices": [], "usage": _USAGE}
    await resp.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
    await resp.write_eof()
    return resp


def test_the_usage_stripper_hides_the_usage_the_client_did_not_ask_for() -> None:
    async def scenario() -> None:
        async with serve(sse_with_usage_chunk) as streamed, serve(echo) as buffered:
            _, _, stream, _, results = await run_proxy(
                [ProxyTarget(WorkerId("s"), streamed)], {"prompt": "q", "stream": True},
                UsageStripper,
            )  # fmt: skip
            _, _, body, _, _ = await run_proxy(
                [ProxyTarget(WorkerId("b"), buffered)], {"prompt": "q"}, UsageStripper
            )
        # Two text events and [DONE], each followed by one blank line: the usage chunk is
        # gone with its blank line, and so are the nulls of the others.
        assert stream.decode() == (
            'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
            'data: {"choices":[{"index":0,"text":"b"}]}\n\n'
            "data: [DONE]\n\n"
        )
        assert results[0].usage == _USAGE  # type: ignore[attr-defined]  # still counted
        assert json.loads(body)["usage"] == _USAGE  # a whole answer keeps its usage

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
        except (ConnectionResetError, asyncio.CancelledError):
            stopped.set()  # the router closed its side
            raise
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


class Counted:
    """A worker handler (:attr:`handle`) that counts the requests it got."""

    def __init__(self, handler: Handler) -> None:
        self.count = 0

        async def handle(request: web.Request) -> web.StreamResponse:
            self.count += 1
            return await handler(request)

        self.handle = handle


def test_an_answer_that_blames_the_request_goes_back_as_is_and_is_never_replayed() -> None:
    """A 4xx says the request is at fault; a 500 (or a 503 that does not say the worker is
    draining or overloaded) says it failed on the worker: replaying it elsewhere could
    fail, or kill, the next worker too."""
    answers = [
        (400, "invalid_request_error"),
        (500, "request_failed"),
        (503, "request_failed"),
        (502, None),
    ]

    async def scenario() -> None:
        for code, kind in answers:
            first, second = Counted(status(code, kind)), Counted(echo)
            async with serve(first.handle) as failing, serve(second.handle) as good:
                targets = [ProxyTarget(WorkerId("a"), failing), ProxyTarget(WorkerId("b"), good)]
                got, headers, body, rec, _ = await run_proxy(targets, {"prompt": "x"})
            error = {"message": f"status {code}"} | ({"type": kind} if kind else {})
            assert (got, json.loads(body)) == (code, {"error": error})
            assert headers["X-Kvroute-Worker"] == "a"
            assert (first.count, second.count) == (1, 0), code
            assert [c[:2] for c in rec.calls] == [("start", "a"), ("first_byte", "a"), ("end", "a")]

    asyncio.run(scenario())


def test_a_request_that_kills_workers_is_tried_on_two_at_most() -> None:
    """Each worker drops the connection on the request (as a crash would): the retry
    budget stops it after the second, whatever the number of candidates."""

    async def scenario() -> None:
        workers = [Counted(hang_up) for _ in range(3)]
        async with (
            serve(workers[0].handle) as u0,
            serve(workers[1].handle) as u1,
            serve(workers[2].handle) as u2,
        ):
            targets = [ProxyTarget(WorkerId(f"w{i}"), u) for i, u in enumerate([u0, u1, u2])]
            code, _, _, _, results = await run_proxy(targets, {"prompt": "x"})
        assert code == 502
        (exc,) = results
        assert isinstance(exc, WorkersUnavailableError)
        assert [f.split(":")[0] for f in exc.failures] == ["w0", "w1"]
        assert [w.count for w in workers] == [1, 1, 0]

    asyncio.run(scenario())


@asynccontextmanager
async def frozen(answer_first: int = 0) -> AsyncIterator[str]:
    """A worker that stops answering (as a SIGSTOPped or cut-off one): it accepts
    connections and reads requests, answers the first ``answer_first`` (keep-alive), then
    nothing more, ``GET /health`` included."""
    answered = 0
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if answered >= answer_first:
                    await reader.read()  # silent until the peer hangs up
                    return
                answered += 1
                body = json.dumps({"choices": [{"text": "early"}]}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


FAST = ProxyConfig(connect_timeout_s=1.0, first_byte_timeout_s=1.0)
FAILOVER_BOUND_S = FAST.first_byte_timeout_s + FAST.connect_timeout_s + 3.0
"""Silence window + liveness probe, with room for a loaded machine."""


@pytest.mark.slow
def test_a_frozen_worker_is_failed_over_and_a_slow_live_one_waited_on() -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(3 * FAST.first_byte_timeout_s)  # silent, but /health answers
        return await echo(request)

    async def scenario() -> None:
        async with frozen() as ice, serve(echo) as good, serve(slow) as patient:
            breakers = CircuitBreakers()
            started = time.monotonic()
            code, headers, _, _, results = await run_proxy(
                [ProxyTarget(WorkerId("ice"), ice), ProxyTarget(WorkerId("good"), good)],
                {"prompt": "x"},
                make_proxy=lambda s: WorkerProxy(s, FAST, breakers),
            )
            took = time.monotonic() - started
            assert (code, headers["X-Kvroute-Worker"]) == (200, "good")
            assert took < FAILOVER_BOUND_S
            (result,) = results
            assert result.num_attempts == 2  # type: ignore[attr-defined]
            (failure,) = result.failures  # type: ignore[attr-defined]
            assert failure == "ice: silent for 1 s and no answer to GET /health within 1 s"
            assert breakers.state(WorkerId("ice")) is CircuitState.OPEN  # avoided from now
            code, headers, _, _, results = await run_proxy(
                [ProxyTarget(WorkerId("slow"), patient), ProxyTarget(WorkerId("good"), good)],
                {"prompt": "y"},
                config=FAST,
            )
        assert (code, headers["X-Kvroute-Worker"]) == (200, "slow")
        assert results[0].num_attempts == 1  # type: ignore[attr-defined]

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.slow
def test_the_silence_limit_holds_on_a_pooled_connection() -> None:
    """The worker answers once over a keep-alive connection, then freezes: the next
    request, sent over the same pooled connection, fails over just as fast."""

    async def scenario() -> None:
        async with frozen(answer_first=1) as ice, serve(echo) as good:
            targets = [ProxyTarget(WorkerId("ice"), ice), ProxyTarget(WorkerId("good"), good)]
            recorder = Recorder()
            async with aiohttp.ClientSession() as upstream:
                proxy = WorkerProxy(upstream, FAST)
                first = await proxy_once(proxy, targets, recorder)
                started = time.monotonic()
                second = await proxy_once(proxy, targets, recorder)
                took = time.monotonic() - started
        assert (first.worker_id, second.worker_id) == ("ice", "good")
        assert took < FAILOVER_BOUND_S
        assert recorder.calls[3:] == [
            ("start", "ice"),
            ("end", "ice", "failed"),
            ("start", "good"),
            ("first_byte", "good"),
            ("end", "good", "ok"),
        ]

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.slow
def test_a_worker_found_dead_fails_over_every_request_silent_on_it() -> None:
    """Two requests wait on a frozen worker; the first one's failed probe gives up the
    second too (silent since), which fails over then instead of after its own window."""
    config = ProxyConfig(connect_timeout_s=1.0, first_byte_timeout_s=2.0)

    async def scenario() -> None:
        async with frozen() as ice, serve(echo) as good:
            targets = [ProxyTarget(WorkerId("ice"), ice), ProxyTarget(WorkerId("good"), good)]
            recorder = Recorder()
            async with aiohttp.ClientSession() as upstream:
                proxy = WorkerProxy(upstream, config)
                first = asyncio.ensure_future(proxy_once(proxy, targets, recorder))
                await eventually(lambda: ("start", "ice") in recorder.calls, "the first attempt")
                second = await proxy_once(proxy, targets, recorder)
                done = await first
        assert (done.worker_id, second.worker_id) == ("good", "good")
        assert done.failures == ["ice: silent for 2 s and no answer to GET /health within 1 s"]
        assert second.failures == [
            "ice: silent for 2 s and no answer to GET /health within 1 s "
            "(found by another request to it)"
        ]

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def proxy_once(
    proxy: WorkerProxy, targets: list[ProxyTarget], recorder: Recorder
) -> ProxyResult:
    """One request through ``proxy`` behind a real front server; returns what happened."""
    results: list[ProxyResult] = []

    async def front(request: web.Request) -> web.StreamResponse:
        response, result = await proxy.forward(
            request, "/v1/completions", await request.read(), targets, recorder
        )
        results.append(result)
        return response

    async with (
        serve(front) as url,
        aiohttp.ClientSession() as client,
        client.post(f"{url}/v1/completions", json={"prompt": "x"}) as resp,
    ):
        assert resp.status == 200
    (result,) = results
    return result


def test_an_open_circuit_skips_the_worker_without_an_attempt() -> None:
    async def scenario() -> None:
        breakers = CircuitBreakers()
        dead = ProxyTarget(WorkerId("dead"), _dead_url())
        async with serve(echo) as good:
            targets = [dead, ProxyTarget(WorkerId("good"), good)]
            calls = []
            for _ in range(2):
                _, headers, _, rec, results = await run_proxy(
                    targets, {"prompt": "x"}, make_proxy=lambda s: WorkerProxy(s, FAST, breakers)
                )
                assert headers["X-Kvroute-Worker"] == "good"
                calls.append([c[:2] for c in rec.calls])
        # Refused: unreachable, so open at once; the second request does not try it.
        assert calls[0][0] == ("start", "dead")
        assert ("start", "dead") not in calls[1]
        assert results[0].num_attempts == 1  # type: ignore[attr-defined]
        assert breakers.state(WorkerId("dead")) is CircuitState.OPEN

    asyncio.run(scenario())


@pytest.mark.slow
def test_the_total_timeout_and_mid_stream_silence_end_a_request() -> None:
    hung_up = asyncio.Event()

    async def endless(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(60)  # alive (its /health answers), just never done
        except asyncio.CancelledError:
            hung_up.set()  # the router closed the request
            raise
        return web.Response()

    async def one_event_then_silence(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await asyncio.sleep(60)
        return resp

    async def no_health(_: web.Request) -> web.Response:
        await asyncio.sleep(60)  # the worker's HTTP side is stuck too
        return web.Response()

    async def scenario() -> None:
        config = ProxyConfig(connect_timeout_s=0.5, first_byte_timeout_s=0.5, total_timeout_s=1.5)
        async with serve(endless) as slow, serve(one_event_then_silence, no_health) as stuck:
            started = time.monotonic()
            code, _, _, rec, results = await run_proxy(
                [ProxyTarget(WorkerId("slow"), slow), ProxyTarget(WorkerId("b"), slow)],
                {"prompt": "x"},
                config=config,
            )
            assert time.monotonic() - started < 1.5 + 3.0
            assert code == 502
            (exc,) = results
            assert isinstance(exc, WorkersUnavailableError) and exc.timed_out
            assert exc.failures == ["slow: no complete answer within the total timeout (1.5 s)"]
            assert [c[:2] for c in rec.calls] == [("start", "slow"), ("end", "slow")]
            await asyncio.wait_for(hung_up.wait(), 10)
            code, _, body, rec, results = await run_proxy(
                [ProxyTarget(WorkerId("stuck"), stuck)], {"prompt": "x", "stream": True},
                config=config,
            )  # fmt: skip
        # The event that came went through; then the stream ended (no retry after a byte).
        assert (code, body) == (200, b'data: {"choices": [{"text": "a"}]}\n\n')
        assert rec.calls[-1] == ("end", "stuck", "failed")

    asyncio.run(asyncio.wait_for(scenario(), 60))
