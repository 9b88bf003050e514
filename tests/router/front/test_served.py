"""What the router learns from answers of a vLLM-shaped worker: usage asked for, hits counted."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from tests.support.router_app import JSON, EchoWorker, echo_workers, running_router


@dataclass
class VllmLikeWorker(EchoWorker):
    """Streams like vLLM: ``usage`` only with ``stream_options.include_usage``, in a last
    chunk of its own with no choices, the hit under ``prompt_tokens_details`` (``null``
    unless ``details``)."""

    details: bool = True
    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def completions(self, request: web.Request) -> web.StreamResponse:  # type: ignore[override]
        body = await request.json()
        self.bodies.append(body)
        n = len(body["prompt"])
        cached = {"cached_tokens": 16} if self.details else None
        usage = {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1,
                 "prompt_tokens_details": cached}  # fmt: skip
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        chunk = {"id": "cmpl-1", "model": "served-model",
                 "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}  # fmt: skip
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            last = {"id": "cmpl-1", "model": "served-model", "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(last)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.mark.parametrize("details", [True, False])
def test_router_asks_a_streaming_vllm_for_usage_and_counts_its_hits(
    redis_url: str, namespace: str, details: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.front.accuracy")

    async def scenario() -> str:
        async with (
            echo_workers(1, VllmLikeWorker) as (worker,),
            running_router(redis_url, namespace, [worker]) as (_, client),
        ):
            assert isinstance(worker, VllmLikeWorker)
            worker.details = details
            for prompt in ("a" * 40, "b" * 40):
                body = {"prompt": prompt, "max_tokens": 1, "stream": True, "model": "served-model"}
                async with client.post("/v1/completions", json=body, headers=JSON) as resp:
                    assert resp.status == 200
                    await resp.read()
            assert all(b["stream_options"] == {"include_usage": True} for b in worker.bodies)
            async with client.get("/metrics") as resp:
                return await resp.text()

    metrics = asyncio.run(scenario())
    if details:
        assert 'kvroute_router_reported_cached_tokens_total{worker="w0"} 32.0' in metrics
        assert 'kvroute_router_expected_cached_tokens_total{worker="w0"} 0.0' in metrics
        assert 'kvroute_router_prompt_tokens_total{worker="w0"} 80.0' in metrics
        ttft = 'kvroute_router_time_to_first_token_seconds_count{model="served-model",worker="w0"}'
        assert f"{ttft} 2.0" in metrics
    else:
        assert 'kvroute_router_unreported_cached_tokens_requests_total{worker="w0"} 2.0' in metrics
        assert 'kvroute_router_reported_cached_tokens_total{worker="w0"}' not in metrics
        (warning,) = [r.getMessage() for r in caplog.records if r.name == "router.front.accuracy"]
        assert warning.startswith("worker w0 answered without usage.cached_tokens")
        assert "--enable-prompt-tokens-details" in warning
