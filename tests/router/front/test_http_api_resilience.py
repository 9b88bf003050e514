"""The router's HTTP API under bad clients and bad workers: real router, Redis, HTTP servers.

Clients that leave (mid-body, mid-stream, while waiting), slow bodies, routing loops,
unknown paths, failing workers' circuits, readiness, and Redis refusing writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
import uuid
from typing import Any

import aiohttp
import pytest
import redis
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from router.front.breaker import BreakerConfig
from router.front.config import RequestLimits
from router.front.proxy_contracts import ProxyConfig
from router.front.service import RouterService
from router.store.server import RedisServer, free_port
from router.workers.registry import WorkerRecord
from tests.support.polling import eventually
from tests.support.router_app import (
    EchoWorker,
    Scenario,
    echo_workers,
    post,
    run,
    running_router,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
BOUND_S = 30.0
"""Longest wait for something another task does (generous: a loaded 2-core machine)."""
PROXY = ProxyConfig(connect_timeout_s=0.5, first_byte_timeout_s=1.0)
"""Fails a silent worker over in about 1.5 s."""
SOONER_BOUND_S = 15.0
"""A health poll's period and timeout (0.2 + 1 s) + the probe (0.5 s), with room for a
loaded 2-core machine."""


async def scrape(client: aiohttp.ClientSession) -> Samples:
    async with client.get("/metrics") as resp:
        text = await resp.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class PatientWorker(EchoWorker):
    """Streams forever or never finishes a buffered answer; records when it is hung up on."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.hung_up = asyncio.Event()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(body["prompt"])
        if not body.get("stream"):
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.01)  # computing; watching the router's connection
            self.hung_up.set()  # the router closed the request
            return web.Response()
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b'data: {"choices": [{"index": 0, "text": "t"}]}\n\n')
                await asyncio.sleep(0.01)
        except ConnectionResetError:
            self.hung_up.set()  # the router closed the stream
        return resp


async def send_raw(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


def test_clients_that_leave_are_counted_never_errors(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Mid-body, mid-stream and while waiting for a buffered answer: the worker's request
    is closed, the abort counted by stage, no ERROR logged, no 500 counted."""

    async def scenario(svc: RouterService, client: aiohttp.ClientSession) -> None:
        (worker,) = workers
        # Half a body, then the client closes.
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n"
        )
        _, writer = await send_raw(svc.port, head + b'{"prompt": ')
        writer.close()

        async def counted(stage: str, count: float) -> bool:
            samples = await scrape(client)
            return value(samples, "kvroute_router_client_aborts_total", stage=stage) == count

        await eventually(lambda: counted("body", 1), "the mid-body abort", timeout_s=BOUND_S)
        # Mid-stream: the first event arrives, then the client leaves.
        resp = await client.post("/v1/completions", json={"prompt": "s", "stream": True})
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()
        await asyncio.wait_for(worker.hung_up.wait(), BOUND_S)
        await eventually(lambda: counted("answer", 1), "the mid-stream abort", timeout_s=BOUND_S)
        # Waiting for a buffered answer that the worker is still computing.
        worker.hung_up.clear()
        request = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "b"}))

        async def reached() -> bool:
            return len(worker.prompts) == 2

        await eventually(reached, "the buffered request to reach the worker", timeout_s=BOUND_S)
        request.cancel()  # the client gives up and closes its connection
        await asyncio.wait_for(worker.hung_up.wait(), BOUND_S)
        await eventually(lambda: counted("answer", 2), "the abort while waiting", timeout_s=BOUND_S)
        samples = await scrape(client)
        statuses = {
            dict(labels)["status"]: v
            for (name, labels), v in samples.items()
            if name == "kvroute_router_http_requests_total"
            and dict(labels)["endpoint"] == "/v1/completions"
        }
        assert statuses == {"499": 3.0}
        attempts = value(samples, "kvroute_router_proxy_attempts_total", worker="w0",
                         outcome="aborted")  # fmt: skip
        assert attempts == 2

    async def main() -> None:
        async with (
            echo_workers(1, PatientWorker) as ws,
            running_router(redis_url, namespace, ws) as (svc, client),
        ):
            workers.extend(ws)
            await scenario(svc, client)

    workers: list[Any] = []
    with caplog.at_level(logging.DEBUG, logger="router"):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


@pytest.mark.slow
def test_a_body_sent_too_slowly_gets_a_408_and_the_connection_closes(
    redis_url: str, namespace: str
) -> None:
    async def scenario(svc: RouterService, client: aiohttp.ClientSession, _: Any) -> None:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n"
        )
        reader, writer = await send_raw(svc.port, head + b'{"prompt"')  # then stalls
        started = time.monotonic()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
        assert time.monotonic() - started < 0.5 + 5.0
        status_line, *fields = head.decode().split("\r\n")
        headers = dict(f.split(": ", 1) for f in fields if f)
        assert status_line == "HTTP/1.1 408 Request Timeout"
        assert headers["Connection"] == "close"  # the rest of the body is not waited for
        body = json.loads(await reader.readexactly(int(headers["Content-Length"])))
        writer.close()
        assert body == {
            "error": {"message": "request body not received within 0.5 s", "type": "timeout"}
        }

    run(redis_url, namespace, scenario, limits=RequestLimits(body_read_timeout_s=0.5))


def test_a_routing_loop_is_refused_on_its_first_pass(redis_url: str, namespace: str) -> None:
    """Router A's worker URL points at router B and B's at A: one request comes back to A
    once, is refused there (508), and the refusal goes back to the client."""

    def pointing_at(url: str) -> WorkerRecord:
        return WorkerRecord(
            worker_id="loop",
            events_endpoint=f"ipc://{tempfile.gettempdir()}/kvroute-{uuid.uuid4().hex}",
            http_url=url,
        )

    async def main() -> None:
        async with (
            running_router(redis_url, namespace + "-a", []) as (svc_a, client_a),
            running_router(redis_url, namespace + "-b", []) as (svc_b, client_b),
        ):
            await svc_a.add_worker(pointing_at(svc_b.url))
            await svc_b.add_worker(pointing_at(svc_a.url))
            status, body = await asyncio.wait_for(
                post(client_a, "/v1/completions", {"prompt": "x"}), BOUND_S
            )
            assert status == 508
            assert body["error"]["type"] == "loop_detected"
            assert body["error"]["message"] == (
                f"routing loop: this request already passed through router "
                f"{svc_a.replica_id!r} (hops: {svc_a.replica_id}, {svc_b.replica_id}); "
                "a registered worker URL points at a router"
            )
            handled_a = value(await scrape(client_a), "kvroute_router_http_requests_total",
                              endpoint="/v1/completions", status="508")  # fmt: skip
            handled_b = value(await scrape(client_b), "kvroute_router_http_requests_total",
                              endpoint="/v1/completions", status="508")  # fmt: skip
            assert (handled_a, handled_b) == (2, 1)  # A, B, A refused: three passes
            # A request naming this router in its hops is refused without routing.
            async with client_a.post(
                "/v1/completions",
                json={"prompt": "x"},
                headers={"X-Kvroute-Hops": f"gw,{svc_a.replica_id}"},
            ) as resp:
                assert resp.status == 508

    asyncio.run(main())


def test_unknown_paths_and_methods_get_json_errors(redis_url: str, namespace: str) -> None:
    async def scenario(svc: RouterService, client: aiohttp.ClientSession, _: Any) -> None:
        async with client.get("/nowhere") as resp:
            assert resp.status == 404
            assert await resp.json() == {
                "error": {"message": "GET /nowhere: no such endpoint",
                          "type": "invalid_request_error"}
            }  # fmt: skip
        async with client.post("/health", data=b"{}") as resp:
            assert resp.status == 405
            assert resp.headers["Allow"] == "GET, HEAD"
            assert await resp.json() == {
                "error": {"message": "POST /health: method not allowed; allowed: GET, HEAD",
                          "type": "invalid_request_error"}
            }  # fmt: skip
        async with client.delete("/v1/completions") as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
            assert (await resp.json())["error"]["type"] == "invalid_request_error"

    run(redis_url, namespace, scenario, n=0)


def test_ready_needs_a_routable_worker_and_health_stays_live(
    redis_url: str, namespace: str
) -> None:
    dead = WorkerRecord(
        worker_id="gone",
        events_endpoint=f"ipc://{tempfile.gettempdir()}/kvroute-{uuid.uuid4().hex}",
        http_url=f"http://127.0.0.1:{free_port()}",  # nothing listens there
    )

    async def get(client: aiohttp.ClientSession, path: str) -> tuple[int, Any]:
        async with client.get(path) as resp:
            return resp.status, await resp.json()

    async def main() -> None:
        async with running_router(redis_url, namespace, []) as (_, client):
            status, ready = await get(client, "/ready")
            reason = "no worker with an HTTP URL is registered"
            assert (status, ready["ready"], ready["reasons"]) == (503, False, [reason])
            assert ready["error"] == {"message": f"not ready: {reason}", "type": "not_ready"}
            assert (await get(client, "/health"))[0] == 200
        async with (
            echo_workers(1) as ws,
            running_router(redis_url, namespace + "-2", ws) as (_, client),
        ):
            status, ready = await get(client, "/ready")
            assert (status, ready["ready"], ready["routable_workers"]) == (200, True, ["w0"])
            assert (ready["index"], ready["index_writable"], ready["reasons"]) == ("live", True, [])
        async with running_router(redis_url, namespace + "-3", [], health_poll_s=0.1) as (
            svc,
            client,
        ):
            await svc.add_worker(dead)

            async def not_ready() -> bool:
                return (await get(client, "/ready"))[0] == 503

            await eventually(not_ready, "/ready to see the worker is down", timeout_s=BOUND_S)
            _, ready = await get(client, "/ready")
            assert ready["reasons"] == ["no routable worker: gone gives no answer to GET /health"]
            status, health = await get(client, "/health")
            assert (status, health["status"]) == (200, "ok")  # the process itself works

    asyncio.run(main())


class FailingWorker(EchoWorker):
    """w0 fails every request (a JSON 500); the others answer."""

    async def completions(self, request: web.Request) -> web.Response:
        if self.worker_id != "w0":
            return await super().completions(request)
        self.prompts.append((await request.json())["prompt"])
        error = {"message": "the request failed", "type": "request_failed"}
        return web.json_response({"error": error}, status=500)


def test_a_failing_worker_is_skipped_once_its_circuit_opens(redis_url: str, namespace: str) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        answers = [
            (await post(client, "/v1/completions", {"prompt": f"p{i}"}))[0] for i in range(10)
        ]
        # Round robin sends w0 every other request until its second 500 opens its
        # circuit; each 500 went back to its client as is (never replayed on w1).
        assert answers == [500, 200, 500] + [200] * 7
        assert (len(ws[0].prompts), len(ws[1].prompts)) == (2, 8)
        async with client.get("/v1/workers") as resp:
            circuits = {w["worker_id"]: w["circuit"] for w in (await resp.json())["workers"]}
        assert circuits["w1"] == {"state": "closed", "consecutive_failures": 0, "retry_in_s": None}
        assert circuits["w0"]["state"] == "open"
        assert circuits["w0"]["consecutive_failures"] == 2
        assert 0 < circuits["w0"]["retry_in_s"] <= 60
        samples = await scrape(client)
        assert value(samples, "kvroute_router_worker_circuit_state", worker="w0") == 2
        assert value(samples, "kvroute_router_worker_circuit_state", worker="w1") == 0
        assert value(samples, "kvroute_router_circuit_opens_total", worker="w0") == 1

    async def main() -> None:
        async with (
            echo_workers(2, FailingWorker) as ws,
            running_router(
                redis_url,
                namespace,
                ws,
                policy="round_robin",
                breaker=BreakerConfig(failure_threshold=2, cooldown_s=60),
            ) as (svc, client),
        ):
            await scenario(svc, client, ws)

    asyncio.run(main())


class CutWorker(EchoWorker):
    """w0 answers nothing, ``GET /health`` included, until ``reconnect`` is set (a worker
    whose link went down: connections are accepted, no byte comes back)."""

    reconnected: asyncio.Event | None = None

    async def _cut(self) -> None:
        if self.worker_id == "w0":
            assert CutWorker.reconnected is not None
            await CutWorker.reconnected.wait()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await self._cut()
        return await super().completions(request)

    async def health(self, request: web.Request) -> web.Response:
        await self._cut()
        return await super().health(request)


def with_cut_worker(redis_url: str, namespace: str, scenario: Scenario, **overrides: Any) -> None:
    """Run ``scenario`` against a round-robin router (health polled every 0.2 s, the fast
    ``PROXY`` unless overridden) over two :class:`CutWorker` s, w0 cut off until the
    scenario reconnects it (at the end at the latest: the servers then stop at once)."""
    CutWorker.reconnected = asyncio.Event()

    async def cut(svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]) -> None:
        assert CutWorker.reconnected is not None
        try:
            await scenario(svc, client, ws)
        finally:
            CutWorker.reconnected.set()

    run(redis_url, namespace, cut, kind=CutWorker,
        **{"policy": "round_robin", "proxy": PROXY, "health_poll_s": 0.2, **overrides})  # fmt: skip


@pytest.mark.slow
def test_a_cut_off_worker_gets_no_client_trial_until_it_answers_again(
    redis_url: str, namespace: str
) -> None:
    """Its first request fails over and opens its circuit; past the cooldown no client
    request is its trial while it is still silent; once it answers the health poll again
    it is tried and served."""

    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        answers = [await post(client, "/v1/completions", {"prompt": f"p{i}"}) for i in range(2)]
        assert [code for code, _ in answers] == [200, 200]  # w0's request failed over
        assert ws[0].prompts == []

        async def circuit() -> dict[str, Any]:
            async with client.get("/v1/workers") as resp:
                rows = (await resp.json())["workers"]
                return next(w["circuit"] for w in rows if w["worker_id"] == "w0")

        async def cooled_down() -> bool:
            return (await circuit())["state"] == "half_open"

        await eventually(cooled_down, "w0's cooldown to end", timeout_s=BOUND_S)
        started = time.monotonic()
        for i in range(4):  # round robin would send w0 every other one as its trial
            code, body = await post(client, "/v1/completions", {"prompt": f"q{i}"})
            assert (code, body["choices"][0]["text"].split(":")[0]) == (200, "w1")
        assert time.monotonic() - started < PROXY.first_byte_timeout_s  # nobody waited on w0
        assert CutWorker.reconnected is not None
        CutWorker.reconnected.set()

        async def served_again() -> bool:
            await post(client, "/v1/completions", {"prompt": "r"})
            return bool(ws[0].prompts)

        await eventually(served_again, "w0 to be served again", timeout_s=BOUND_S)
        assert (await circuit())["state"] == "closed"

    with_cut_worker(redis_url, namespace, scenario, breaker=BreakerConfig(cooldown_s=0.5))


@pytest.mark.slow
def test_a_worker_its_health_poll_finds_silent_fails_over_before_the_first_byte_timeout(
    redis_url: str, namespace: str
) -> None:
    """A request waits on a worker that went silent; the router's next health poll gets no
    answer either, so the request's worker is probed at once and the request fails over
    in about the poll's period and timeout + the connect timeout, not the first-byte one."""
    patient = ProxyConfig(connect_timeout_s=0.5, first_byte_timeout_s=60.0)

    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        started = time.monotonic()
        answers = [await post(client, "/v1/completions", {"prompt": f"p{i}"}) for i in range(2)]
        took = time.monotonic() - started
        assert [code for code, _ in answers] == [200, 200]  # w0's request failed over
        assert ws[0].prompts == []
        assert took < SOONER_BOUND_S < patient.first_byte_timeout_s

    with_cut_worker(redis_url, namespace, scenario, proxy=patient)


@pytest.mark.slow
def test_redis_refusing_writes_degrades_routing_explicitly(private_redis: RedisServer) -> None:
    """Redis refuses every write (a primary that lost the replicas it must write to) while
    reads still work: the router says the index is not writable and degraded (no longer
    "live"), keeps routing on load, and stays ready."""
    admin = redis.Redis(host=private_redis.host, port=private_redis.port)

    async def scenario(svc: RouterService, client: aiohttp.ClientSession, _: Any) -> None:
        async def health() -> dict[str, Any]:
            async with client.get("/health") as resp:
                assert resp.status == 200
                body: dict[str, Any] = await resp.json()
                return body

        assert ((await health())["index"], (await health())["index_writable"]) == ("live", True)
        admin.config_set("min-replicas-to-write", 1)  # none: every write is refused
        try:

            async def unwritable() -> bool:
                return (await health())["index_writable"] is False

            await eventually(unwritable, "the router to see its writes refused", timeout_s=BOUND_S)
            assert (await health())["index"] == "degraded"
            async with client.get("/ready") as resp:
                ready = await resp.json()
                assert (resp.status, ready["ready"]) == (200, True)
                assert (ready["index"], ready["index_writable"]) == ("degraded", False)
            status, _ = await post(client, "/v1/completions", {"prompt": "still served"})
            assert status == 200
            assert value(await scrape(client), "kvroute_router_index_writable") == 0
        finally:
            admin.config_set("min-replicas-to-write", 0)

        async def writable() -> bool:
            return (await health())["index_writable"] is True

        await eventually(writable, "the router to write again", timeout_s=BOUND_S)
        assert value(await scrape(client), "kvroute_router_index_writable") == 1

    run(private_redis.url, "refusing", scenario, n=1, lease_ttl_s=0.6)
    admin.close()
