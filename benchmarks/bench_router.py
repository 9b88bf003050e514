"""Benchmark: the router's overhead per request, route only and through the proxy.

For 1, 8, 64 and 1,000 workers, in one run and one process: a private ``redis-server``, the
workers, a :class:`router.front.service.RouterService` (cache-aware policy, real Redis index,
shared load, decision recording) and one HTTP client sending requests one at a time.

The workers are trivial aiohttp echo servers (they answer ``/v1/completions`` at once),
so what is measured is the router's own cost, not a model's. The prompt is 8,192 tokens
(512 blocks of 16), sent as token ids (``--prompt text``: as 8,192 bytes of text for the
byte-level tokenizer); eight workers (or all, when fewer) hold its prefix in the index to
depths of 64, 128, ..., 512 blocks, written through the real fenced index path, so every
lookup walks real chains. At 1,000 workers the other 992 hold nothing of it: what they
add is the cost of registered workers that play no part in the prefix.

Rows, each p50 and p99 over ``--requests`` sequential requests (rows interleaved):

* bare: the client posting the same body straight to a worker (the baseline);
* decide: ``RouterService.decide`` called in process (tokens -> keys -> one Redis lookup
  -> load -> policy), no HTTP;
* decider: the pure core of that call alone, :func:`router.routing.decider.decide` on the
  inputs the service gathered (candidates, policy, every candidate's cost terms), no I/O;
* route: ``POST /v1/route`` (decision recorded: predicted entry, load held);
* proxy: ``POST /v1/completions`` through the router to the chosen worker.

Ratios are to the bare round trip of the same row; "overhead" is proxy minus bare.
Client, router and workers share one event loop, so every figure includes the client's
own work, exactly as the baseline does. After start-up the objects are frozen out of the
garbage collector's scans (``gc.freeze()``), as ``kvroute router`` does.

Run: ``python -m benchmarks.bench_router`` (``--quick`` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import aiohttp
import msgspec
from aiohttp import web

from benchmarks.environment import describe
from events.schema import BlockStored, KVEventBatch
from router.cli.event_loop import EVENT_LOOPS, run_on
from router.front.accuracy import AccuracyConfig
from router.front.config import RouterConfig
from router.front.decisions import Routed
from router.front.service import RouterService
from router.index.base import PrefixMatch
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.routing.decider import DecisionInputs
from router.routing.decider import decide as decide_route
from router.routing.policies import RouteRequest
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.store.server import RedisServer, find_redis_server
from router.workers.registry import WorkerRecord, WorkerRegistry

__all__ = ["main"]

BLOCK_SIZE: Final = 16
PROMPT_TOKENS: Final = 8192
HOLDERS: Final = 8
WORKER_COUNTS: Final = (1, 8, 64, 1000)
TARGET_WORKERS: Final = 64
TARGET_ROUTE_P50_MS: Final = 0.7
TARGET_DECIDE_P50_MS: Final = 0.25
TARGET_SCALING: Final = 1.5
HEALTH_POLL_S: Final = 5.0
SETTLE_S: Final = 60.0
_ANSWER: Final = (
    b'{"object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":8192,"completion_tokens":1,"cached_tokens":0}}'
)


async def start_echo_workers(n: int) -> tuple[list[web.AppRunner], list[str]]:
    """``n`` echo workers on loopback: completions answered at once, empty snapshot."""

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=_ANSWER, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "running": 0, "waiting": 0})

    async def snapshot(_: web.Request) -> web.Response:
        return web.json_response({"block_size": BLOCK_SIZE, "runs": [], "next_seq": 0})

    runners, urls = [], []
    for _ in range(n):
        app = web.Application(client_max_size=1 << 24)
        app.add_routes(
            [
                web.post("/v1/completions", completions),
                web.get("/health", health),
                web.get("/v1/snapshot", snapshot),
            ]
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    return runners, urls


async def index_prompt(redis_url: str, namespace: str, records: Sequence[WorkerRecord]) -> None:
    """Register the workers and index the prompt's prefix on up to eight of them.

    The leases are taken here with a one-hour TTL, so the router's ingest leaves these
    entries alone (it ingests only workers whose lease it holds).
    """
    client = await connect(redis_url)
    layout = KeyLayout(namespace)
    index = BridgedIndex(RedisPrefixIndex(client, layout))
    registry = WorkerRegistry(client, layout, lease_ttl_ms=3_600_000)
    tokens = list(prompt_text().encode())
    # A live lease holder for the run (the TTL above): the router leaves these leases,
    # and so the entries written here, alone.
    await registry.hold()
    for i, record in enumerate(records):
        await registry.register(record)
        wid = record.worker_id
        lease = await registry.acquire(wid)
        assert lease is not None
        index.use_lease(wid, lease.token)
        if i < HOLDERS:
            depth = (PROMPT_TOKENS // BLOCK_SIZE) * (i + 1) // min(HOLDERS, len(records))
            event = BlockStored(
                block_hashes=list(range(i * 10_000, i * 10_000 + depth)),
                parent_block_hash=None,
                token_ids=tokens[: depth * BLOCK_SIZE],
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
            await index.apply(wid, KVEventBatch(ts=time.time(), events=[event]))
    await client.aclose()


def prompt_text() -> str:
    """8,192 bytes of text: 8,192 tokens with the byte-level tokenizer."""
    words = "the router keeps a global prefix index of every worker cache "
    return (words * (PROMPT_TOKENS // len(words) + 1))[:PROMPT_TOKENS]


Samples = dict[str, tuple[list[float], list[float]]]
"""Row name -> (wall seconds, CPU seconds of this thread) per call."""


async def timed(calls: dict[str, Callable[[], Awaitable[None]]], n: int) -> Samples:
    """Wall and CPU seconds of ``n`` calls of each, interleaved (one of each per round)
    after a warm-up.

    Interleaving spreads the noise of a shared machine evenly over the rows. The CPU
    seconds are this thread's (client, router and workers share it): what a call costs
    the process, unlike the wall time not stretched while other processes hold the
    cores, so it compares code versions on a loaded box.
    """
    for _ in range(max(3, n // 20)):
        for call in calls.values():
            await call()
    samples: Samples = {name: ([], []) for name in calls}
    for _ in range(n):
        for name, call in calls.items():
            wall, cpu = samples[name]
            start, start_cpu = time.perf_counter(), time.thread_time()
            await call()
            cpu.append(time.thread_time() - start_cpu)
            wall.append(time.perf_counter() - start)
    return samples


async def settled_decision(service: RouterService, tokens: list[int]) -> Routed:
    """A dry-run decision once the router sees the indexed prefix.

    Right after start-up a large cluster's first polls and subscriptions can hold the
    loop past the lookup's timeout (routing then degrades to load for a probe interval).
    """
    deadline = time.monotonic() + SETTLE_S
    while True:
        routed = await service.decide(tokens, 1, record=False)
        if routed.chosen.matched_tokens == PROMPT_TOKENS:
            return routed
        if time.monotonic() > deadline:
            raise AssertionError(f"the router never saw the indexed prompt: {routed.chosen}")
        await asyncio.sleep(0.2)


def gathered_inputs(routed: Routed) -> DecisionInputs:
    """The inputs the service gathered for a decision, rebuilt from its candidates (the
    bench's index holds GPU blocks only, and no predicted entries: dry runs credit none)."""
    decision = routed.decision
    keys = list(routed.keys.base_keys)
    workers = [c.worker_id for c in decision.candidates]
    matches = {
        c.worker_id: PrefixMatch(c.matched_tokens // BLOCK_SIZE, c.matched_tokens // BLOCK_SIZE)
        for c in decision.candidates
        if c.matched_tokens
    }
    loads = {c.worker_id: c.load for c in decision.candidates}
    request = RouteRequest(keys, routed.num_prompt_tokens, BLOCK_SIZE, routed.num_output_tokens)
    return DecisionInputs(request, workers, loads, matches)


def pct(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


def request_body(prompt: str) -> bytes:
    """The completion body the route and proxy rows send: the prompt as ``"ids"`` (token
    ids) or as ``"text"``."""
    text = prompt_text()
    value = (
        msgspec.json.encode(list(text.encode())) if prompt == "ids" else msgspec.json.encode(text)
    )
    return b'{"prompt": ' + value + b', "max_tokens": 1}'


async def measure(redis_url: str, num_workers: int, requests: int, prompt: str = "ids") -> Samples:
    """Every row's samples for one cluster size."""
    runners, urls = await start_echo_workers(num_workers)
    namespace = f"bench-router-{num_workers}-{os.getpid()}-{time.monotonic_ns()}"
    records = [
        WorkerRecord(
            worker_id=f"w{i}",
            # Nobody binds it: a free TCP port could be taken by another process meanwhile.
            events_endpoint=f"ipc://{tempfile.gettempdir()}/kvroute-bench-{os.getpid()}-{i}",
            http_url=url,
            block_size=BLOCK_SIZE,
        )
        for i, url in enumerate(urls)
    ]
    await index_prompt(redis_url, namespace, records)
    # The echo workers answer their health polls on this event loop: polled every second
    # (the default), 1,000 of them would measure their own answers, and a loaded box
    # delays those past the point where the router drops a worker as dead.
    config = RouterConfig(
        redis_url=redis_url,
        namespace=namespace,
        port=0,
        health_poll_s=HEALTH_POLL_S,
        dead_after_s=3600.0,
        # The echo workers cache nothing, so their reported hits never match the index
        # this bench wrote: no accuracy warnings in the tables.
        accuracy=AccuracyConfig(warn_below_ratio=0.0),
    )
    service = await RouterService.open(config)
    gc.freeze()  # as `kvroute router` does once started
    body = request_body(prompt)
    headers = {"Content-Type": "application/json"}
    tokens = list(prompt_text().encode())
    try:
        assert len(service.workers) == num_workers
        routed = await settled_decision(service, tokens)
        expected = min(HOLDERS, num_workers)
        assert sum(1 for c in routed.decision.candidates if c.matched_tokens) == expected
        assert decide_route(service.policy, gathered_inputs(routed)) == routed.decision
        async with aiohttp.ClientSession() as client:

            async def post(url: str) -> None:
                async with client.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status

            async def decide() -> None:
                await service.decide(tokens, 1, record=False)

            inputs = gathered_inputs(routed)

            async def decider() -> None:
                decide_route(service.policy, inputs)

            calls: dict[str, Callable[[], Awaitable[None]]] = {
                "bare": lambda: post(f"{urls[0]}/v1/completions"),
                "decide": decide,
                "decider": decider,
                "route": lambda: post(f"{service.url}/v1/route"),
                "proxy": lambda: post(f"{service.url}/v1/completions"),
            }
            return await timed(calls, requests)
    finally:
        await service.close()
        for runner in runners:
            await runner.cleanup()


def report_targets(p50s: dict[int, dict[str, float]]) -> None:
    """The targets' lines: /v1/route and decide at 64 workers, and 1,000 against 64."""
    if TARGET_WORKERS not in p50s:
        return
    at = p50s[TARGET_WORKERS]
    for name, target in (("route", TARGET_ROUTE_P50_MS), ("decide", TARGET_DECIDE_P50_MS)):
        status = "met" if at[name] <= target else "MISSED"
        print(f"target: {name} p50 at {TARGET_WORKERS} workers {at[name]:.3f} ms "
              f"(<= {target} ms): {status}")  # fmt: skip
    most = max(p50s)
    if most != TARGET_WORKERS:
        for name in ("route", "decide"):
            ratio = p50s[most][name] / at[name]
            status = "met" if ratio <= TARGET_SCALING else "MISSED"
            print(f"target: {name} p50 at {most} workers / at {TARGET_WORKERS}: {ratio:.2f} "
                  f"(<= {TARGET_SCALING}): {status}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="few requests, seconds-long")
    parser.add_argument("--requests", type=int, default=1000, help="timed requests per row")
    parser.add_argument(
        "--prompt", choices=("ids", "text"), default="ids", help="prompt sent as (default: ids)"
    )
    parser.add_argument(
        "--workers",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=WORKER_COUNTS,
        help="cluster sizes, comma-separated (default: 1,8,64,1000)",
    )
    parser.add_argument(
        "--loop",
        choices=EVENT_LOOPS,
        default="asyncio",
        help="event loop of the one process (default: asyncio; auto: uvloop when installed)",
    )
    args = parser.parse_args(argv)
    requests = 40 if args.quick else args.requests
    binary = find_redis_server()
    print(describe(("aiohttp", "redis", "hiredis"), redis_server=binary))
    print(
        f"prompt {PROMPT_TOKENS} tokens ({args.prompt}, {PROMPT_TOKENS // BLOCK_SIZE} blocks), "
        f"{requests} sequential requests per row, echo workers (router overhead only)"
    )
    print("| workers | row | p50 ms | p99 ms | p50 / bare p50 | CPU p50 ms | CPU / bare CPU |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    p50s: dict[int, dict[str, float]] = {}
    with RedisServer(binary=binary) as server:
        for n in args.workers:
            rows = run_on(args.loop, measure(server.url, n, requests, args.prompt))
            bare, bare_cpu = (pct(samples, 0.5) for samples in rows["bare"])
            for name, (wall, cpu) in rows.items():
                p50, p99, cpu50 = pct(wall, 0.5), pct(wall, 0.99), pct(cpu, 0.5)
                print(f"| {n} | {name} | {p50:.3f} | {p99:.3f} | {p50 / bare:.2f} "
                      f"| {cpu50:.3f} | {cpu50 / bare_cpu:.2f} |")  # fmt: skip
            overhead = pct(rows["proxy"][0], 0.5) - bare
            overhead_cpu = pct(rows["proxy"][1], 0.5) - bare_cpu
            print(f"| {n} | proxy overhead (proxy - bare) | {overhead:.3f} | | "
                  f"| {overhead_cpu:.3f} | |")  # fmt: skip
            p50s[n] = {name: pct(wall, 0.5) for name, (wall, _) in rows.items()}
    report_targets(p50s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
