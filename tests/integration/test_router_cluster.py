"""Routers in front of real workers: affinity, saturation, replicas, a killed worker, vLLM wires.

Workers are real ``kvroute worker`` subprocesses (tiny model, CPU, one torch thread); the
routers run in process so the tests can read their index and load directly. A "vLLM"
engine is a raw ZeroMQ PUB socket publishing hand-encoded batches in vLLM's map shape or
its legacy array shape, beside an aiohttp stand-in for its HTTP API.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from aiohttp import web

from events.chat_template import BuiltinChatTemplate
from events.framing import make_message
from events.identity import WorkerId
from router.front.tokenization import TokenizerSources
from router.index.redis_index import RedisPrefixIndex
from router.routing.cost import CostWeights
from router.routing.policies import PolicyConfig
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.store.server import RedisServer
from router.workers.registry import WorkerRecord
from tests.support.polling import eventually
from tests.support.router_cluster import (
    BLOCK,
    BOUND_S,
    WorkerProc,
    complete,
    dry_route,
    router,
    start_workers,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]






@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProc]]:
    """Three workers shared by the tests that do not kill any (distinct prompts per test)."""
    started = start_workers(["a", "b", "c"])
    yield started
    for w in started:
        w.kill()








def matched(route: dict[str, Any]) -> dict[str, int]:
    return {c["worker_id"]: c["matched_tokens"] for c in route["candidates"] if c["matched_tokens"]}


def test_prefix_affinity_then_spreading_under_load(
    redis_url: str, namespace: str, workers: list[WorkerProc]
) -> None:
    prefix = "You are a careful assistant. " * 9  # 261 bytes: 16 full blocks shared
    # Explicit weights, so the test does not depend on the defaults: the caching worker
    # (56 tokens of work per sibling) takes siblings until its queue costs more than a cold
    # worker's 2,104 (each in-flight sibling adds 256 + 48 + 7 = 311): 7 of the burst of 9.
    weights = CostWeights(prefill=8.0, queued_prefill=1.0, decode=1.0, per_request=256.0)

    async def scenario() -> None:
        async with (
            router(
                redis_url,
                namespace,
                [w.record() for w in workers],
                policy_config=PolicyConfig(weights=weights),
            ) as svc,
            aiohttp.ClientSession() as s,
        ):
            first, usage0 = await complete(s, svc.url, prefix + "Q0")
            await eventually(
                lambda: _holds(s, svc.url, prefix + "Q1", first, 256),
                "the prefix in the index",
                timeout_s=BOUND_S,
            )
            for i in range(1, 4):
                served, usage = await complete(s, svc.url, prefix + f"Q{i}")
                assert served == first
                assert usage["cached_tokens"] == 256  # confirmed by the worker itself
            # Saturation: a burst of long siblings cannot all fit on the caching worker.
            burst = await asyncio.gather(
                *(complete(s, svc.url, prefix + f"R{i}", 48) for i in range(9))
            )
            per_worker = {
                w.worker_id: sum(1 for sv, _ in burst if sv == w.worker_id) for w in workers
            }
            assert per_worker[first] >= 3  # affinity still pays ...
            assert sum(1 for n in per_worker.values() if n) >= 2  # ... but load spread the rest
            hits = sum(u["cached_tokens"] for _, u in burst)
            assert hits >= 256 * per_worker[first]  # graceful: the cached worker's hits stay
            # The router counted exactly the hits the workers reported.
            async with s.get(f"{svc.url}/metrics") as resp:
                metrics = await resp.text()
            reported = usage0["cached_tokens"] + 3 * 256 + hits
            name = "kvroute_router_reported_cached_tokens_total"
            assert sum(_sample(metrics, name, w.worker_id) for w in workers) == reported

    asyncio.run(scenario())


def _sample(metrics: str, name: str, worker: str) -> float:
    """A counter's value for one worker in Prometheus text (0 when absent)."""
    prefix = f'{name}{{worker="{worker}"}} '
    lines = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(lines[0][len(prefix) :]) if lines else 0.0


async def _holds(s: aiohttp.ClientSession, url: str, prompt: str, worker: str, tokens: int) -> bool:
    return matched(await dry_route(s, url, prompt)).get(worker, 0) >= tokens


def test_two_replicas_share_index_and_load(
    redis_url: str, namespace: str, workers: list[WorkerProc]
) -> None:
    records = [w.record() for w in workers]
    prefix = "Replica test system prompt, identical everywhere. " * 4  # 204 bytes: 12 blocks

    async def scenario() -> None:
        async with (
            router(redis_url, namespace, records, route_hold_s=60.0) as one,
            router(redis_url, namespace, [], route_hold_s=60.0) as two,
            aiohttp.ClientSession() as s,
        ):
            # The index is shared: what one replica's ingest wrote, the other reads.
            first, _ = await complete(s, one.url, prefix + "x")
            await eventually(
                lambda: _holds(s, two.url, prefix + "y", first, 192),
                "the index via two",
                timeout_s=BOUND_S,
            )
            served, usage = await complete(s, two.url, prefix + "y")
            assert (served, usage["cached_tokens"]) == (first, 192)
            # The load is shared: decisions alternate between replicas, each one seeing
            # the other's; with equal caches (none) they never pick the same worker.
            chosen: list[str] = []
            for i, replica in enumerate([one, two, one]):
                async with s.post(f"{replica.url}/v1/route", json={"prompt": f"{i}" * 64}) as resp:
                    chosen.append((await resp.json())["worker_id"])
                other_url = (two if replica is one else one).url
                await eventually(
                    lambda u=other_url: _sees_load(s, u, chosen),  # type: ignore[misc]
                    "the other replica's view",
                    timeout_s=BOUND_S,
                )
            assert sorted(chosen) == ["a", "b", "c"]

    asyncio.run(scenario())


def test_streamed_chat_through_real_workers_reuses_the_system_prompt(
    redis_url: str, namespace: str, workers: list[WorkerProc]
) -> None:
    system = {"role": "system", "content": "Answer in one short sentence, politely. " * 6}

    async def chat(s: aiohttp.ClientSession, url: str, question: str) -> tuple[str, list[Any]]:
        body = {"messages": [system, {"role": "user", "content": question}], "max_tokens": 4,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.content_type == "text/event-stream"
            lines = [line async for line in resp.content if line.startswith(b"data: ")]
            served = resp.headers["X-Kvroute-Worker"]
        assert lines[-1] == b"data: [DONE]\n"
        return served, [json.loads(line[6:]) for line in lines[:-1]]

    async def scenario() -> None:
        async with (
            router(redis_url, namespace, [w.record() for w in workers]) as svc,
            aiohttp.ClientSession() as s,
        ):
            first, chunks = await chat(s, svc.url, "Why is the sky blue?")
            assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            prompt = BuiltinChatTemplate().render(
                [system, {"role": "user", "content": "Why is grass green?"}]
            )
            shared = len(prompt.encode()) // BLOCK * BLOCK
            await eventually(
                lambda: _holds(s, svc.url, prompt, first, 256),
                "the system prompt indexed",
                timeout_s=BOUND_S,
            )
            again, chunks = await chat(s, svc.url, "Why is grass green?")
            usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
            assert again == first
            assert 256 <= usage["cached_tokens"] < shared  # the common system prompt was reused

    asyncio.run(scenario())


def test_redis_restart_degrades_then_rebuilds_the_index(
    private_redis: RedisServer, workers: list[WorkerProc]
) -> None:
    prefix = "Outage-proof prefix, cached before Redis goes away. " * 6  # 312 bytes
    ns = "outage"

    async def scenario() -> None:
        async with (
            router(
                private_redis.url, ns, [w.record() for w in workers], probe_interval_s=0.2
            ) as svc,
            aiohttp.ClientSession() as s,
        ):
            first, _ = await complete(s, svc.url, prefix + "a")
            await eventually(
                lambda: _holds(s, svc.url, prefix + "b", first, 304),
                "the prefix indexed",
                timeout_s=BOUND_S,
            )
            private_redis.stop()
            for i in range(3):  # served on load alone, never a 5xx
                await complete(s, svc.url, f"{i} unrelated prompt while Redis is down")
            async with s.get(f"{svc.url}/health") as resp:
                assert (await resp.json())["index"] == "degraded"
            private_redis.start()  # empty: the ingest re-registers and reloads snapshots
            await eventually(
                lambda: _holds(s, svc.url, prefix + "c", first, 304),
                "the index rebuilt",
                timeout_s=90,
            )
            served, usage = await complete(s, svc.url, prefix + "c")
            assert (served, usage["cached_tokens"]) == (first, 304)

    asyncio.run(scenario())


async def _sees_load(s: aiohttp.ClientSession, url: str, chosen: list[str]) -> bool:
    route = await dry_route(s, url, "probe")
    loads = {c["worker_id"]: c["load"]["num_requests"] for c in route["candidates"]}
    return all(loads[w] >= chosen.count(w) for w in chosen)


@asynccontextmanager
async def vllm_http(worker_id: str) -> AsyncIterator[str]:
    """A stand-in for a vLLM engine's HTTP API (completions echo, empty /health, /metrics,
    and /tokenize: the byte-level ids its events carry)."""

    async def tokenize(request: web.Request) -> web.Response:
        tokens = list((await request.json())["prompt"].encode())
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        text = f"{worker_id}:{body['prompt'][:4]}"
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        return web.json_response({"choices": [{"text": text}], "usage": usage})

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            text="# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
        )

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/health", health),
                    web.get("/metrics", metrics), web.post("/tokenize", tokenize)])  # fmt: skip
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _map_batch(tokens: list[int], hashes: list[int]) -> bytes:
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
             "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
             "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0}  # fmt: skip
    return msgspec.msgpack.encode([time.time(), [event], 0])


def _array_batch(tokens: list[int], hashes: list[int]) -> bytes:
    event = ["BlockStored", hashes, None, tokens, BLOCK, None, "GPU", None]
    return msgspec.msgpack.encode([time.time(), [event], 0])


def test_foreign_publishers_in_map_and_legacy_array_shapes(redis_url: str, namespace: str) -> None:
    prompts = {"vmap": "M" * 64 + "tail", "varr": "A" * 64 + "tail"}
    encoders = {"vmap": _map_batch, "varr": _array_batch}
    ctx = zmq.Context.instance()
    socks = {name: ctx.socket(zmq.PUB) for name in prompts}
    ports = {name: sock.bind_to_random_port("tcp://127.0.0.1") for name, sock in socks.items()}

    async def scenario() -> None:
        async with vllm_http("vmap") as url_map, vllm_http("varr") as url_arr:
            urls = {"vmap": url_map, "varr": url_arr}
            records = [
                WorkerRecord(
                    worker_id=n,
                    events_endpoint=f"tcp://127.0.0.1:{ports[n]}",
                    http_url=urls[n],
                    kind="vllm",
                    block_size=BLOCK,
                )
                for n in prompts
            ]
            via_engine = TokenizerSources.from_flags(via_engine=[""])  # the engines' /tokenize
            async with (
                router(redis_url, namespace, records, tokenizers=via_engine) as svc,
                aiohttp.ClientSession() as s,
            ):
                seq = 0

                async def published_and_indexed() -> bool:
                    nonlocal seq
                    for name, sock in socks.items():  # re-publish until the SUB has joined
                        tokens = list(prompts[name][:64].encode())
                        payload = encoders[name](tokens, [1000 + 10 * seq + i for i in range(4)])
                        sock.send_multipart(make_message(b"", seq, payload))
                    seq += 1
                    routes = [await dry_route(s, svc.url, prompts[n]) for n in prompts]
                    return all(
                        matched(r).get(n) == 64 for n, r in zip(prompts, routes, strict=True)
                    )

                await eventually(
                    published_and_indexed, "both foreign streams in the index", timeout_s=BOUND_S
                )
                async with s.get(f"{svc.url}/metrics") as resp:
                    metrics = await resp.text()
                for name in prompts:  # every batch the ingest applied is counted per worker
                    assert (
                        f'kvroute_ingest_batches_total{{outcome="applied",worker="{name}"}}'
                        in metrics
                    )
                for name, prompt in prompts.items():
                    route = await dry_route(s, svc.url, prompt)
                    assert (route["worker_id"], route["matched_tokens"]) == (name, 64)
                    assert matched(route) == {name: 64}
                    async with s.post(f"{svc.url}/v1/completions", json={"prompt": prompt}) as resp:
                        assert resp.status == 200
                        assert resp.headers["X-Kvroute-Worker"] == name
                        assert (await resp.json())["choices"][0]["text"] == f"{name}:{prompt[:4]}"

    try:
        asyncio.run(scenario())
    finally:
        for sock in socks.values():
            sock.close(linger=0)


LONG = 512
"""Tokens of a request that must still be running when its worker is killed (at 64, one
could finish between the health poll that saw it and the kill on a loaded machine)."""


async def _running(s: aiohttp.ClientSession, url: str) -> bool:
    async with s.get(f"{url}/health") as resp:
        body = await resp.json()
    return int(body["running"]) + int(body["waiting"]) >= 1


async def _no_entries(index: RedisPrefixIndex, worker: str) -> bool:
    return not await index.worker_entries(WorkerId(worker))


def test_killed_worker_requests_retried_and_entries_leave(
    redis_url: str, namespace: str, workers: list[WorkerProc]
) -> None:
    """Runs last: it kills one of the module's workers."""
    pair = workers[:2]
    prefix = "Long shared context for the doomed worker. " * 6  # 264 bytes: 16 blocks

    async def scenario() -> None:
        async with (
            router(redis_url, namespace, [w.record() for w in pair], lease_ttl_s=2.0) as svc,
            aiohttp.ClientSession() as s,
        ):
            doomed, _ = await complete(s, svc.url, prefix + "0")
            victim = next(w for w in pair if w.worker_id == doomed)
            await eventually(
                lambda: _holds(s, svc.url, prefix + "1", doomed, 256),
                "the prefix indexed",
                timeout_s=BOUND_S,
            )
            # In flight on the doomed worker (its prefix attracts them), then it dies.
            inflight = [
                asyncio.ensure_future(complete(s, svc.url, prefix + f"r{i}", LONG))
                for i in range(3)
            ]
            await eventually(
                lambda: _running(s, victim.http),
                "requests running on the victim",
                timeout_s=BOUND_S,
            )
            victim.kill()
            results = await asyncio.gather(*inflight)
            survivor = next(w.worker_id for w in pair if w is not victim)
            assert [served for served, _ in results] == [survivor] * 3
            # Its entries leave the index within its lease (plus a maintenance pass).
            index = RedisPrefixIndex(await connect(redis_url), KeyLayout(namespace))
            killed_at = time.monotonic()
            await eventually(
                lambda: _no_entries(index, doomed), "the dead worker's entries gone", timeout_s=30
            )
            assert time.monotonic() - killed_at < 2.0 * 3
            route = await dry_route(s, svc.url, prefix + "2")
            assert doomed not in [c["worker_id"] for c in route["candidates"]]
            await index.client.aclose()

    asyncio.run(scenario())
