"""Request ids and trace context through a real router: answered, forwarded, logged."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp

from tests.support.router_app import JSON, echo_workers, running_router

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
HEX32 = re.compile(r"[0-9a-f]{32}")


async def ask(
    client: aiohttp.ClientSession, path: str, body: object, headers: dict[str, str]
) -> tuple[int, str]:
    """Status and ``X-Request-Id`` of an answer."""
    async with client.post(path, data=json.dumps(body), headers={**JSON, **headers}) as resp:
        await resp.read()
        return resp.status, resp.headers["X-Request-Id"]


def test_request_ids_and_trace_context_go_to_the_worker_the_client_and_the_log(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    log = tmp_path / "decisions.jsonl"

    async def scenario() -> None:
        async with (
            echo_workers(1) as (worker,),
            running_router(redis_url, namespace, [worker], decision_log=str(log)) as (_, client),
        ):
            completion = {"prompt": "hello", "max_tokens": 1}
            # The client's id and trace: kept, forwarded, logged.
            traced = {
                "X-Request-Id": "client-id 42",
                "traceparent": f"00-{TRACE}-{PARENT}-01",
                "tracestate": "vendor=abc",
            }
            assert await ask(client, "/v1/completions", completion, traced) == (200, "client-id 42")
            sent = worker.headers[-1]
            assert (sent["x-request-id"], sent["traceparent"], sent["tracestate"]) == (
                "client-id 42", f"00-{TRACE}-{PARENT}-01", "vendor=abc"
            )  # fmt: skip
            # No id: one is made; a malformed trace context is dropped, not forwarded.
            status, made = await ask(
                client, "/v1/completions", completion,
                {"traceparent": f"00-{TRACE}-{'0' * 16}-01", "tracestate": "vendor=abc"},
            )  # fmt: skip
            assert status == 200 and HEX32.fullmatch(made)
            sent = worker.headers[-1]
            assert sent["x-request-id"] == made
            assert "traceparent" not in sent and "tracestate" not in sent
            # An unusable id (too long, or not printable ASCII) is replaced, not forwarded.
            for bad in ("x" * 129, "caf\u00e9".encode().decode("latin-1")):
                status, replaced = await ask(
                    client, "/v1/completions", completion, {"X-Request-Id": bad}
                )
                assert status == 200 and HEX32.fullmatch(replaced)
                assert worker.headers[-1]["x-request-id"] == replaced
            # Errors and streams name the request too; /v1/route decisions are logged.
            assert await ask(client, "/v1/completions", {"prompt": ""}, {"X-Request-Id": "e1"}) == (
                400, "e1"
            )  # fmt: skip
            routed = await ask(client, "/v1/route", {"prompt": "hi"}, {"X-Request-Id": "r1"})
            assert routed == (200, "r1")
            async with client.get("/health", headers={"X-Request-Id": "h1"}) as resp:
                assert resp.headers["X-Request-Id"] == "h1"

    asyncio.run(scenario())
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(d["request_id"], d["trace_id"]) for d in lines] == [
        ("client-id 42", TRACE),
        (lines[1]["request_id"], None),
        (lines[2]["request_id"], None),
        (lines[3]["request_id"], None),
        ("r1", None),
    ]
    assert HEX32.fullmatch(lines[1]["request_id"])

