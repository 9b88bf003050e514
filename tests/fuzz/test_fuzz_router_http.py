"""HTTP fuzzing of a running ``kvroute router``: bad bodies get a 4xx with a clear message.

One router subprocess with one worker behind it, started with small limits given on the
command line (``--max-body-bytes``, ``--max-prompt-tokens``), so the test also shows the
limits are configurable. Every answer to a fuzzed body is 200 (a valid request, routed
and proxied) or a 4xx JSON error ``{"error": {"message", "type"}}``; never a 5xx, a
dropped connection or a hang; both processes stay up.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.cluster.runner import ProcessGroup, wait_healthy
from router.store.server import RedisServer, free_port
from tests.support.json_values import json_values
from tests.support.raw_http import REPLY_TIMEOUT_S, post

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

MAX_BODY_BYTES = 64 * 1024
MAX_PROMPT_TOKENS = 200
ENDPOINTS = ("/v1/completions", "/v1/route", "/v1/chat/completions")


def error_message(body: Any) -> str:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert {"message", "type"} <= set(body["error"]), body
    message = str(body["error"]["message"])
    assert len(message) >= 10, body
    return message


@pytest.fixture(scope="module")
def decision_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("decisions") / "decisions.jsonl"


@pytest.fixture(scope="module")
def router_port(tmp_path_factory: pytest.TempPathFactory, decision_log: Path) -> Iterator[int]:
    worker, events, router = free_port(), free_port(), free_port()
    worker_url = f"http://127.0.0.1:{worker}"
    with RedisServer() as redis, ProcessGroup(tmp_path_factory.mktemp("router-fuzz")) as group:
        group.start(
            "worker",
            [sys.executable, "-m", "router", "worker", "--id", "w0", "--port", str(worker),
             "--events", f"tcp://127.0.0.1:{events}", "--num-blocks", "128", "--block-size", "8",
             "--num-layers", "1", "--hidden-size", "16", "--num-heads", "2"],
        )  # fmt: skip
        group.start(
            "router",
            [sys.executable, "-m", "router", "router", "--redis", redis.url,
             "--port", str(router), "--log-level", "WARNING",
             "--worker", f"w0={worker_url},events=tcp://127.0.0.1:{events},block-size=8",
             "--max-body-bytes", str(MAX_BODY_BYTES),
             "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
             "--decision-log", str(decision_log)],
        )  # fmt: skip

        async def ready() -> None:
            deadline = time.monotonic() + 120
            async with aiohttp.ClientSession() as session:
                for url in (worker_url, f"http://127.0.0.1:{router}"):
                    await wait_healthy(session, url, group, deadline)

        asyncio.run(ready())
        yield router
        group.check_alive()  # no example crashed either process


prompts = st.one_of(
    json_values,
    st.text(min_size=1, max_size=30),
    st.lists(st.integers(min_value=-3, max_value=2**33), max_size=20),
    st.lists(st.integers(min_value=0, max_value=255), min_size=150, max_size=400),
)
messages = st.one_of(
    json_values,
    st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "role": st.one_of(json_values, st.sampled_from(["user", "system"])),
                "content": st.one_of(json_values, st.text(max_size=30)),
            },
        ),
        max_size=3,
    ),
)
fields = {
    "prompt": prompts,
    "messages": messages,
    "max_tokens": st.one_of(json_values, st.integers(min_value=-2, max_value=3)),
    "stream": st.one_of(json_values, st.booleans()),
    "dry_run": st.one_of(json_values, st.booleans()),
    "cache_salt": st.one_of(json_values, st.text(max_size=8)),
    "temperature": json_values,
}
bodies = st.one_of(st.fixed_dictionaries({}, optional=fields), json_values)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.sampled_from(ENDPOINTS), bodies)
def test_any_json_body_gets_200_or_a_clear_4xx(router_port: int, path: str, body: Any) -> None:
    status, reply = post(router_port, path, json.dumps(body).encode())
    if status == 200:
        return
    assert 400 <= status < 500, (status, reply)
    error_message(reply)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"", "request body is empty"),
        (b'{"prompt": "\xff\xfe"}', "request body"),
        (b"\xc3\x28" * 10, "not valid JSON"),
        (b'{"prompt": [1, 2', "not valid JSON"),
        (b"[1, 2, 3]", "invalid request body"),
        (b'{"prompt": "abc", "max_tokens": "7"}', "invalid request body"),
        (b'{"prompt": [1, -2]}', "invalid request body"),
    ],
)
def test_bad_bodies_name_the_problem(router_port: int, path: str, raw: bytes, words: str) -> None:
    status, reply = post(router_port, path, raw)
    assert status == 400, reply
    assert words in error_message(reply)


def test_lone_surrogate_prompt_is_a_4xx(router_port: int) -> None:
    status, reply = post(router_port, "/v1/completions", b'{"prompt": "a\\ud800b"}')
    assert status == 400, reply
    assert error_message(reply).startswith("request body is not valid JSON")


def test_the_configured_prompt_limit_applies(router_port: int) -> None:
    tokens = [1] * (MAX_PROMPT_TOKENS + 1)
    for path in ("/v1/completions", "/v1/route"):
        status, reply = post(router_port, path, json.dumps({"prompt": tokens}).encode())
        assert status == 400, reply
        message = error_message(reply)
        assert (
            f"prompt has {MAX_PROMPT_TOKENS + 1} tokens; the limit is {MAX_PROMPT_TOKENS}"
            in message
        )


@pytest.mark.parametrize("size", [MAX_BODY_BYTES + 1, 16 * MAX_BODY_BYTES])
def test_the_configured_body_limit_applies(router_port: int, size: int) -> None:
    body = (b'{"prompt": [' + b"1," * size)[:size]
    status, reply = post(router_port, "/v1/completions", body)
    assert status == 413, reply
    assert f"request body exceeds the limit of {MAX_BODY_BYTES} bytes" in error_message(reply)


def test_worker_registration_rejects_bad_bodies(router_port: int) -> None:
    for raw, words in [
        (b'{"worker_id": "x"}', "invalid request body"),
        (b'{"worker_id": "x", "url": "ftp://a", "events": "tcp://127.0.0.1:1"}', "must start"),
        (b'{"worker_id": "x", "url": "http://a", "events": "tcp://h:1", "zzz": 1}', "zzz"),
        (b'{"worker_id": "x", "url": "http://a", "events": "e"}', "events endpoint 'e'"),
        (
            b'{"worker_id": "x", "url": "http://a", "events": "tcp://h:1", "block_size": 0}',
            "block_size must be 1-4096",
        ),
    ]:
        status, reply = post(router_port, "/v1/workers", raw)
        assert status == 400, (raw, reply)
        assert words in error_message(reply), reply
    conn = http.client.HTTPConnection("127.0.0.1", router_port, timeout=REPLY_TIMEOUT_S)
    try:
        conn.request("DELETE", "/v1/workers/nobody")
        response = conn.getresponse()
        assert response.status == 404
        error_message(json.loads(response.read()))
    finally:
        conn.close()


def test_router_still_routes_after_the_fuzzing(router_port: int) -> None:
    status, reply = post(router_port, "/v1/completions", b'{"prompt": "hello", "max_tokens": 1}')
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] in ("length", "stop")


def test_decision_log_is_json_lines_after_the_fuzzing(router_port: int, decision_log: Path) -> None:
    """What the router logged about the fuzzed requests is JSON, one object a line (no pickle)."""
    status, _ = post(router_port, "/v1/route", b'{"prompt": "last one"}')
    assert status == 200
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while not decision_log.exists() or decision_log.stat().st_size == 0:
        assert time.monotonic() < deadline, "no decision logged"
        time.sleep(0.05)  # the router appends from its own process
    lines = decision_log.read_bytes().splitlines()
    assert lines
    for line in lines:
        assert not line.startswith(b"\x80")  # a pickle's PROTO opcode
        assert isinstance(json.loads(line), dict)
