"""The router's OpenAI surface with stand-in workers over real HTTP: models, bodies forwarded
as sent, usage on streams, batch prompts, the vLLM tokenizer requirement, engine tokenization."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.front.config import RouterConfig
from router.front.service import RouterService
from router.front.tokenization import TokenizerSources
from router.workers.registration import RegistrationError
from router.workers.registry import WorkerRecord
from tests.support.paths import REPO_ROOT as REPO
from tests.support.router_app import JSON, EchoWorker, echo_workers, post, running_router

DEADLINE_S = 30.0

Check = Callable[[RouterService, aiohttp.ClientSession, list[EchoWorker]], Awaitable[None]]


def run_with_models(
    redis_url: str,
    namespace: str,
    models: list[list[str] | None],
    check: Check,
    **overrides: Any,
) -> None:
    """Run ``check`` against a router in front of one stand-in worker per ``models`` entry
    (the names it lists at ``GET /v1/models``; ``None``: it lists none), once the router
    has learned them."""

    async def main() -> None:
        async with echo_workers(len(models)) as workers:
            for worker, names in zip(workers, models, strict=True):
                worker.models = names
            async with running_router(redis_url, namespace, workers, **overrides) as (
                svc,
                client,
            ):
                expected = {n for names in models for n in names or ()}
                await until(lambda: listed(client, expected), "the workers' models learned")
                await check(svc, client, workers)

    asyncio.run(main())


async def listed(client: aiohttp.ClientSession, expected: set[str]) -> bool:
    async with client.get("/v1/models") as resp:
        return {m["id"] for m in (await resp.json())["data"]} == expected


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)  # polling a condition with a deadline


async def served_by(
    client: aiohttp.ClientSession, body: dict[str, Any], path: str = "/v1/completions"
) -> str:
    async with client.post(path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Kvroute-Worker"]


def test_models_are_the_union_and_requests_go_only_to_their_workers(
    redis_url: str, namespace: str
) -> None:
    async def check(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        async with client.get("/v1/models") as resp:
            listing = await resp.json()
        assert listing["object"] == "list"
        assert [(m["id"], m["owned_by"]) for m in listing["data"]] == [
            ("llama", "w0"), ("llama-lora", "w1"), ("qwen", "w2"),
        ]  # fmt: skip
        for _ in range(4):
            assert await served_by(client, {"prompt": "x", "model": "qwen"}) == "w2"
            assert await served_by(client, {"prompt": "y", "model": "llama-lora"}) == "w1"
            assert await served_by(client, {"prompt": "z", "model": "llama"}) in ("w0", "w1")
        status, err = await post(client, "/v1/completions", {"prompt": "x", "model": "gpt-4"})
        assert (status, err) == (
            404,
            {
                "error": {
                    "message": "The model `gpt-4` does not exist. The workers behind this "
                    "router serve: llama, llama-lora, qwen",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "model_not_found",
                }
            },
        )
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("/v1/route", {"prompt": "x"}),
        ):
            status, err = await post(client, path, {**body, "model": "gpt-4"})
            assert (status, err["error"]["code"]) == (404, "model_not_found")
        # Several models: a request must name one.
        status, err = await post(client, "/v1/completions", {"prompt": "x"})
        assert (status, err["error"]["param"]) == (400, "model")
        assert "'model' is required" in err["error"]["message"]
        assert sum(len(w.bodies) for w in ws) == 12  # nothing else reached a worker

    models: list[list[str] | None] = [["llama"], ["llama", "llama-lora"], ["qwen"]]
    run_with_models(redis_url, namespace, models, check)


def test_registered_models_and_workers_whose_models_are_unknown(
    redis_url: str, namespace: str
) -> None:
    async def check(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        # w1 lists no models: requests for a model nobody is known to serve may go there.
        assert await served_by(client, {"prompt": "x", "model": "mystery"}) == "w1"
        # A registration may name the models itself (the worker is not asked then).
        body = {"worker_id": "w9", "url": ws[1].url, "events": "tcp://127.0.0.1:1",
                "models": ["named"]}  # fmt: skip
        status, added = await post(client, "/v1/workers", body)
        assert status == 201
        assert added["worker"]["models"] == ["named"]
        assert await listed(client, {"only", "named"})
        assert await served_by(client, {"prompt": "x", "model": "named"}) == "w9"
        status, err = await post(client, "/v1/workers", {**body, "worker_id": "w8",
                                                          "models": ["a", "a"]})  # fmt: skip
        assert status == 400
        assert "models: a name is given twice" in err["error"]["message"]

    run_with_models(redis_url, namespace, [["only"], None], check)


def test_a_single_model_router_serves_requests_without_model(
    redis_url: str, namespace: str
) -> None:
    async def check(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        assert await served_by(client, {"prompt": "x"}) in ("w0", "w1")
        raw = {"messages": [{"role": "user", "content": "x"}]}
        assert await served_by(client, raw, "/v1/chat/completions") in ("w0", "w1")

    run_with_models(redis_url, namespace, [["m"], ["m"]], check)


def test_bodies_reach_the_worker_as_the_client_sent_them(redis_url: str, namespace: str) -> None:
    # Odd spacing, key order, number forms and fields the router does not know.
    completion = (
        b'{ "zeta": {"nested": [1, 2.50, null]},"prompt" :"hello",  "max_tokens": 2,'
        b' "guided_json": {"type": "object"}, "temperature": 1e-1, "logit_bias": {"50256": -100}}'
    )
    chat = b'{"messages":[{"role":"user","content":"hi","name":"bob"}],"tools":[],"seed":7}'

    async def check(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        for path, raw in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            async with client.post(path, data=raw, headers=JSON) as resp:
                assert resp.status == 200
        assert [b for w in ws for b in w.bodies] == [
            ("/v1/completions", completion),
            ("/v1/chat/completions", chat),
        ]

    run_with_models(redis_url, namespace, [["m"]], check)


async def _sse(client: aiohttp.ClientSession, body: dict[str, Any]) -> list[Any]:
    raw = json.dumps(body, separators=(",", ":")).encode()
    async with client.post("/v1/completions", data=raw, headers=JSON) as resp:
        assert resp.status == 200
        events = [e for e in (await resp.read()).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_streams_ask_for_usage_and_hide_it_unless_the_client_asked(
    redis_url: str, namespace: str
) -> None:
    async def check(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        plain = await _sse(client, {"prompt": "a", "stream": True})
        assert [c["choices"] != [] and "usage" not in c for c in plain] == [True]
        # The worker was asked for the usage: the only change to the client's body.
        _, sent = ws[0].bodies[-1]
        assert sent == b'{"stream_options":{"include_usage":true},"prompt":"a","stream":true}'
        asked = await _sse(
            client, {"prompt": "b", "stream": True, "stream_options": {"include_usage": True}}
        )
        assert asked[-1]["choices"] == []
        assert asked[-1]["usage"]["prompt_tokens"] == 1
        assert json.loads(ws[0].bodies[-1][1])["stream_options"] == {"include_usage": True}
        # A stream_options without include_usage keeps its other options.
        await _sse(client, {"prompt": "c", "stream": True, "stream_options": {"x": 1}})
        assert json.loads(ws[0].bodies[-1][1])["stream_options"] == {"x": 1, "include_usage": True}

    run_with_models(redis_url, namespace, [["m"]], check)


def test_a_batch_prompt_is_routed_prompt_by_prompt_and_merged_in_order(
    redis_url: str, namespace: str
) -> None:
    async def check(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        prompts = ["first " * 20, "second " * 20, "third " * 20]
        body = {"prompt": prompts, "max_tokens": 2, "user": "u-7"}
        async with client.post("/v1/completions", json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
            served = resp.headers["X-Kvroute-Worker"].split(",")
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
        # Each prompt went alone, with the client's other fields, to the worker named.
        by_worker = {w.worker_id: w for w in ws}
        for i, (prompt, worker_id) in enumerate(zip(prompts, served, strict=True)):
            sent = [json.loads(raw) for _, raw in by_worker[worker_id].bodies]
            assert {"prompt": prompt, "max_tokens": 2, "user": "u-7"} in sent
            assert answer["choices"][i]["text"].startswith(worker_id + ":")
        assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0}
        status, err = await post(client, "/v1/completions", {**body, "stream": True})
        assert (status, err["error"]["param"]) == (400, "stream")
        assert "a batch prompt (3 prompts) cannot be streamed" in err["error"]["message"]
        status, err = await post(client, "/v1/route", body)
        assert status == 400
        assert "POST /v1/route takes one prompt" in err["error"]["message"]

    run_with_models(redis_url, namespace, [["m"], ["m"]], check)


def test_a_vllm_worker_without_a_tokenizer_is_refused_with_the_fixes(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    fixes = ("--tokenizer PATH", "--tokenize-via-engine")
    vllm = WorkerRecord(
        worker_id="v0", events_endpoint="tcp://127.0.0.1:1", http_url="http://127.0.0.1:9",
        kind="vllm",
    )  # fmt: skip

    async def check(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        body = {"worker_id": "v0", "url": "http://127.0.0.1:9", "events": "tcp://127.0.0.1:1",
                "kind": "vllm"}  # fmt: skip
        status, err = await post(client, "/v1/workers", body)
        assert status == 400
        assert "worker 'v0' is a vLLM engine (kind=vllm)" in err["error"]["message"]
        assert all(fix in err["error"]["message"] for fix in fixes)
        with pytest.raises(RegistrationError, match="kind=vllm"):
            await svc.add_worker(vllm)
        named = {**body, "models": ["llama"]}  # named models, none with a tokenizer
        assert (await post(client, "/v1/workers", named))[0] == 400

    run_with_models(redis_url, namespace, [["m"]], check)
    per_model = TokenizerSources.from_flags(via_engine=["llama"])
    per_model.check(WorkerRecord(**{**_fields(vllm), "served_models": ("llama",)}))
    with pytest.raises(RegistrationError, match="no tokenizer for its model qwen"):
        per_model.check(WorkerRecord(**{**_fields(vllm), "served_models": ("llama", "qwen")}))
    # The router refuses to start with one, naming both fixes.
    proc = subprocess.run(
        [sys.executable, "-m", "router", "router", "--redis", redis_url, "--port", "0",
         "--namespace", namespace,
         "--worker", "v0=http://127.0.0.1:9,events=tcp://127.0.0.1:1,kind=vllm"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "worker 'v0' is a vLLM engine (kind=vllm)" in proc.stderr
    assert all(fix in proc.stderr for fix in fixes)


def _fields(record: WorkerRecord) -> dict[str, Any]:
    return {f: getattr(record, f) for f in record.__struct_fields__}


@asynccontextmanager
async def router_client(
    config: RouterConfig,
) -> AsyncIterator[tuple[RouterService, aiohttp.ClientSession]]:
    async with (
        await RouterService.open(config) as service,
        aiohttp.ClientSession(base_url=service.url) as client,
    ):
        yield service, client


def test_engine_tokenization_is_cached_and_fails_over(redis_url: str, namespace: str) -> None:
    calls: list[tuple[str, Any]] = []
    up: dict[str, bool] = {"t0": True, "t1": True}

    def tokenizer_app(worker_id: str) -> web.Application:
        async def tokenize(request: web.Request) -> web.Response:
            body = await request.json()
            calls.append((worker_id, body))
            if not up[worker_id]:
                return web.json_response({"error": {"message": "down"}}, status=503)
            text = body.get("prompt") or json.dumps(body["messages"])
            return web.json_response({"tokens": list(text.encode())[:50], "count": 0})

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "running": 0, "waiting": 0})

        async def completions(request: web.Request) -> web.Response:
            return web.json_response({"choices": [{"index": 0, "text": worker_id}]})

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "llama"}]})

        app = web.Application()
        app.add_routes([web.post("/tokenize", tokenize), web.get("/health", health),
                        web.post("/v1/completions", completions),
                        web.post("/v1/chat/completions", completions),
                        web.get("/v1/models", models)])  # fmt: skip
        return app

    async def main() -> None:
        runners, records = [], []
        for i, wid in enumerate(("t0", "t1")):
            runner = web.AppRunner(tokenizer_app(wid))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            records.append(
                WorkerRecord(
                    worker_id=wid,
                    events_endpoint=f"tcp://127.0.0.1:{i + 1}",
                    http_url=f"http://127.0.0.1:{runner.addresses[0][1]}",
                    kind="vllm",
                )
            )
        sources = TokenizerSources.from_flags(via_engine=["llama"], cache_tokens=80)
        try:
            config = RouterConfig(
                redis_url, namespace, port=0, workers=tuple(records), tokenizers=sources
            )
            async with router_client(config) as (svc, client):
                await until(lambda: listed(client, {"llama"}), "the models learned")
                body = {"prompt": "the same prompt", "model": "llama", "add_special_tokens": False}
                for _ in range(3):
                    assert (await post(client, "/v1/completions", body))[0] == 200
                # One call for three requests: the answer is cached.
                assert [c[1] for c in calls] == [
                    {"prompt": "the same prompt", "add_special_tokens": False, "model": "llama"}
                ]
                chat = {"messages": [{"role": "user", "content": "hi"}], "model": "llama",
                        "add_generation_prompt": True, "temperature": 0.3}  # fmt: skip
                assert (await post(client, "/v1/chat/completions", chat))[0] == 200
                assert calls[-1][1] == {
                    "messages": chat["messages"], "add_generation_prompt": True, "model": "llama",
                }  # fmt: skip
                # A worker that fails is skipped for the next one of the model.
                first = calls[-1][0]
                up[first] = False
                calls.clear()
                assert (await post(client, "/v1/completions", {**body, "prompt": "new"}))[0] == 200
                assert [c[0] for c in calls] == [first, "t1" if first == "t0" else "t0"]
                # With none answering, the request is routed on load alone, and counted.
                up.update(t0=False, t1=False)
                assert (await post(client, "/v1/completions", {**body, "prompt": "new2"}))[0] == 200
                async with client.get("/metrics") as resp:
                    metrics = await resp.text()
                assert (
                    'kvroute_router_unkeyed_requests_total{reason="engine_unavailable"} 1.0'
                    in metrics
                )
                assert 'kvroute_router_engine_tokenize_total{outcome="cache_hit"} 2.0' in metrics
                # The cache is bounded in tokens: 80 here, the longest answers evicted first.
                assert svc.tokenizer.engine is not None
                assert svc.tokenizer.engine.cache.num_tokens <= 80
        finally:
            for runner in runners:
                await runner.cleanup()

    asyncio.run(main())
