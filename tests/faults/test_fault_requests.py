"""Request-path faults through a real router: a frozen worker, a request that kills workers,
clients that leave.

Real ``kvroute router`` processes on loopback; the frozen worker is a real ``kvroute
worker`` stopped with SIGSTOP (it keeps its sockets, so connections are accepted and never
answered, as with a hung host or a cut link); the killer request's workers are small
aiohttp servers in the test that count what reaches them. Expectations: failover within
the stated bound, the bad worker avoided afterwards, a bad request reaching at most two
workers, a client that leaves counted (and its worker's request aborted), never an ERROR.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.cluster.runner import wait_healthy
from tests.support.faults import (
    HOST,
    REQUEST_TIMEOUT_S,
    START_TIMEOUT_S,
    Cluster,
    complete,
    family_prompts,
    get_json,
    metric,
    scrape,
)
from tests.support.polling import wait_until

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

FIRST_BYTE_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0
FAILOVER_BOUND_S = FIRST_BYTE_TIMEOUT_S + CONNECT_TIMEOUT_S + 10.0
"""Silence window + liveness probe + the request on the healthy worker, with room for a
loaded 2-core machine running torch workers."""
POLL_BOUND_S = 30.0


def test_a_frozen_worker_is_failed_over_in_seconds_and_then_avoided(tmp_path: Path) -> None:
    with Cluster(tmp_path) as cluster:
        cluster.start_workers()
        router = cluster.start_router(
            "router",
            [w.spec() for w in cluster.workers],
            "--policy", "round_robin", "--lease-ttl-s", "120",
            "--proxy-first-byte-timeout-s", str(FIRST_BYTE_TIMEOUT_S),
            "--proxy-connect-timeout-s", str(CONNECT_TIMEOUT_S),
            "--circuit-cooldown-s", "600",
        )  # fmt: skip
        cluster.wait_healthy([router])
        prompts = family_prompts(3, 10)
        for prompt in prompts[:4]:  # both workers serve, keep-alive connections pooled
            complete(router, prompt)
        cluster.freeze("w0")
        try:
            took = []
            for prompt in prompts[4:]:
                started = time.monotonic()
                complete(router, prompt)
                took.append(time.monotonic() - started)
            samples = scrape(router)
            status, workers = get_json(f"{router}/v1/workers")
            ready_status, ready = get_json(f"{router}/ready")
        finally:
            cluster.thaw("w0")
        log = cluster.group.log_tail("router", 100_000)
    assert max(took) < FAILOVER_BOUND_S, took
    # One request waited on w0 and failed over; the next ones never tried it.
    failed = metric(samples, "kvroute_router_proxy_attempts_total", worker="w0", outcome="failed")
    assert failed == 1
    # Given up by the first-byte timeout, or sooner when its health poll went unanswered.
    assert re.search(r"w0 failed before answering: silent for [0-9.]+ s.* no answer to GET "
                     r"/health within", log), log[-2000:]  # fmt: skip
    assert metric(samples, "kvroute_router_worker_circuit_state", worker="w0") == 2
    assert metric(samples, "kvroute_router_circuit_opens_total", worker="w0") == 1
    circuits = {w["worker_id"]: w["circuit"]["state"] for w in workers["workers"]}
    assert (status, circuits) == (200, {"w0": "open", "w1": "closed"})
    assert (ready_status, ready["ready"], ready["routable_workers"]) == (200, True, ["w1"])


class KillableWorkers:
    """Stand-in workers in the test process. A ``KILL`` prompt crashes the one it reaches
    (the connection drops, as when the process dies; it is back at once), ``FAIL`` gets a
    JSON 500 (the request failed on the worker), ``BAD`` a 400; anything else an answer.
    ``seen[prompt]`` counts which workers each prompt reached."""

    def __init__(self) -> None:
        self.seen: dict[str, Counter[str]] = {}

    def handler(self, worker_id: str) -> Any:
        async def completions(request: web.Request) -> web.StreamResponse:
            prompt = (await request.json())["prompt"]
            self.seen.setdefault(prompt, Counter())[worker_id] += 1
            if prompt == "KILL":
                assert request.transport is not None
                request.transport.close()
                return web.Response()  # goes nowhere
            if prompt in ("FAIL", "BAD"):
                code, kind = (500, "request_failed") if prompt == "FAIL" else (400, "bad")
                error = {"message": f"{worker_id}: {prompt}", "type": kind}
                return web.json_response({"error": error}, status=code)
            choice = {"index": 0, "text": worker_id, "finish_reason": "length"}
            return web.json_response({"object": "text_completion", "choices": [choice]})

        return completions

    @asynccontextmanager
    async def serve(self, count: int) -> AsyncIterator[list[str]]:
        """Start ``count`` workers; yields the router's ``--worker`` specs."""
        runners = []
        specs = []

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "running": 0, "waiting": 0})

        async def snapshot(_: web.Request) -> web.Response:
            return web.json_response({"block_size": 16, "runs": [], "next_seq": 0})

        for i in range(count):
            app = web.Application()
            app.router.add_post("/v1/completions", self.handler(f"k{i}"))
            app.router.add_get("/health", health)
            app.router.add_get("/v1/snapshot", snapshot)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, HOST, 0).start()
            runners.append(runner)
            url = f"http://{HOST}:{runner.addresses[0][1]}"
            events = f"ipc://{tempfile.gettempdir()}/kvroute-{uuid.uuid4().hex}"  # unbound
            specs.append(f"k{i}={url},events={events}")
        try:
            yield specs
        finally:
            for runner in runners:
                await runner.cleanup()


def test_a_request_that_kills_workers_reaches_two_at_most(tmp_path: Path) -> None:
    workers = KillableWorkers()

    async def post(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, Any]:
        body = {"prompt": prompt, "max_tokens": 1}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            return resp.status, await resp.json()

    async def scenario(cluster: Cluster) -> None:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with workers.serve(3) as specs, aiohttp.ClientSession(timeout=timeout) as session:
            router = cluster.start_router("router", specs, "--policy", "round_robin")
            await wait_healthy(session, router, cluster.group, time.monotonic() + START_TIMEOUT_S)
            status, body = await post(session, router, "KILL")
            assert (status, body["error"]["type"]) == (502, "worker_unavailable")
            assert sorted(workers.seen["KILL"].values()) == [1, 1]  # two workers, not three
            status, body = await post(session, router, "FAIL")
            (failed_on,) = workers.seen["FAIL"]  # never replayed
            assert (status, body) == (
                500,
                {"error": {"message": f"{failed_on}: FAIL", "type": "request_failed"}},
            )
            status, body = await post(session, router, "BAD")
            assert status == 400 and sum(workers.seen["BAD"].values()) == 1
            for i in range(6):  # the cluster serves on
                status, body = await post(session, router, f"fine {i}")
                assert status == 200, body
            assert [sum(workers.seen[f"fine {i}"].values()) for i in range(6)] == [1] * 6

    with Cluster(tmp_path, num_workers=0) as cluster:
        asyncio.run(scenario(cluster))
        log = cluster.group.log_tail("router", 100_000)
    assert log.count("failed before answering") == 2
    assert " ERROR " not in log


def test_clients_that_leave_are_counted_and_their_worker_request_aborted(
    tmp_path: Path,
) -> None:
    async def leave_mid_stream(router: str) -> None:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            body = {"prompt": family_prompts(5, 1)[0], "max_tokens": 200, "stream": True}
            resp = await session.post(f"{router}/v1/completions", json=body)
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"data: ")
            resp.close()  # the client leaves after the first event

    async def leave_mid_body(router: str) -> None:
        port = int(re.sub(r".*:", "", router))
        _, writer = await asyncio.open_connection(HOST, port)
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500\r\n\r\n"
        )
        writer.write(head + json.dumps({"prompt": "half"}).encode()[:8])
        await writer.drain()
        writer.close()

    with Cluster(tmp_path, num_workers=1) as cluster:
        cluster.start_workers()
        (worker,) = cluster.workers
        router = cluster.start_router("router", [worker.spec()])
        cluster.wait_healthy([router])
        asyncio.run(leave_mid_stream(router))

        def aborted(url: str, name: str, **labels: str) -> float:
            return metric(scrape(url), name, **labels)

        wait_until(
            lambda: aborted(router, "kvroute_router_client_aborts_total", stage="answer") == 1,
            "the router to count the client that left mid-stream",
            timeout_s=POLL_BOUND_S,
        )
        wait_until(
            lambda: (
                aborted(worker.url, "kvroute_worker_requests_total", finish_reason="abort") == 1
            ),
            "the worker to abort the request the router closed",
            timeout_s=POLL_BOUND_S,
        )
        asyncio.run(leave_mid_body(router))
        wait_until(
            lambda: aborted(router, "kvroute_router_client_aborts_total", stage="body") == 1,
            "the router to count the client that left mid-body",
            timeout_s=POLL_BOUND_S,
        )
        samples = scrape(router)
        log = cluster.group.log_tail("router", 100_000)
    assert metric(samples, "kvroute_router_http_requests_total", status="500") == 0
    assert metric(samples, "kvroute_router_http_requests_total", status="499") == 2
    assert " ERROR " not in log
