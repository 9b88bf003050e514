"""HTTP fuzzing of a running ``kvroute worker``: bad bodies get a 4xx with a clear message.

One worker subprocess (tiny model, small KV cache) serves every example. Bodies: JSON
objects with wrong types, missing fields and unknown fields, non-objects, invalid UTF-8,
lone surrogates, huge token lists and bodies past the size limit. Each must be answered
within a deadline with 200 (a valid request) or a 4xx whose body names the problem;
never a 5xx, a reset connection or a hang; and the worker must stay healthy throughout.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.cluster.runner import ProcessGroup, wait_healthy
from router.store.server import free_port
from tests.support.json_values import json_values
from tests.support.raw_http import REPLY_TIMEOUT_S, post

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

NUM_BLOCKS = 32
BLOCK_SIZE = 8
MAX_REQUEST_TOKENS = (NUM_BLOCKS - 1) * BLOCK_SIZE
"""What the worker's KV cache can ever hold for one request (the null block excluded)."""
VOCAB_SIZE = 258
"""The byte tokenizer's vocabulary: every generated id is below it."""
BODY_LIMIT_BYTES = 1024**2
"""The worker's ``--max-body-bytes`` in these tests."""


def error_message(body: Any) -> str:
    """The message of a JSON error body; a plain-text error fails the test."""
    if isinstance(body, dict):
        assert set(body) == {"error"}, body
        # OpenAI's fields: message and type, and the parameter and code when known.
        assert {"message", "type"} <= set(body["error"]) <= {"message", "type", "param", "code"}
        return str(body["error"]["message"])
    raise AssertionError(f"not an OpenAI-shaped JSON error: {body!r}")


@pytest.fixture(scope="module")
def worker_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    argv = [
        sys.executable, "-m", "router", "worker",
        "--id", "fuzz",
        "--port", str(port),
        "--events", "none",
        "--num-blocks", str(NUM_BLOCKS),
        "--block-size", str(BLOCK_SIZE),
        "--num-layers", "1",
        "--hidden-size", "16",
        "--num-heads", "2",
        "--max-body-bytes", str(BODY_LIMIT_BYTES),
    ]  # fmt: skip
    with ProcessGroup(tmp_path_factory.mktemp("worker-fuzz")) as group:
        group.start("worker", argv)

        async def ready() -> None:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}"
                await wait_healthy(session, url, group, time.monotonic() + 120)

        asyncio.run(ready())
        yield port
        group.check_alive()  # no example crashed it


def assert_alive(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REPLY_TIMEOUT_S)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


prompts = st.one_of(
    json_values,
    st.text(min_size=1, max_size=40),
    st.lists(st.integers(min_value=-5, max_value=300), max_size=40),
    st.lists(st.integers(min_value=0, max_value=255), min_size=MAX_REQUEST_TOKENS, max_size=3000),
)
fields = {
    "prompt": prompts,
    "max_tokens": st.one_of(json_values, st.integers(min_value=-3, max_value=4)),
    "stream": st.one_of(json_values, st.booleans()),
    "temperature": st.one_of(json_values, st.floats(min_value=0, max_value=2)),
    "ignore_eos": st.one_of(json_values, st.booleans()),
    "seed": json_values,
}
bodies = st.one_of(
    st.fixed_dictionaries({}, optional=fields),
    st.fixed_dictionaries({}, optional=fields).flatmap(
        lambda d: st.dictionaries(st.text(max_size=8), json_values, max_size=3).map(
            lambda extra: {**extra, **d}
        )
    ),
    json_values,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(bodies)
def test_any_json_body_gets_200_or_a_clear_4xx(worker_port: int, body: Any) -> None:
    status, reply = post(worker_port, "/v1/completions", json.dumps(body).encode())
    if status == 200:
        if isinstance(reply, dict):
            assert reply["object"] == "text_completion"
        else:  # a stream
            assert reply.rstrip().endswith("data: [DONE]")
        return
    assert 400 <= status < 500, (status, reply)
    assert len(error_message(reply)) >= 10


def _edges(*values: float) -> st.SearchStrategy[float]:
    return st.sampled_from(values)


temperatures = st.one_of(
    _edges(0.0, 5e-324, 1e-300, 1e-40, 1e-3, 0.01, 1.0, 2.0, 2.0000001, 1e308, -1e-300, -1.0),
    st.floats(min_value=-1e308, max_value=1e308),
    st.integers(min_value=-3, max_value=3),
)
top_ps = st.one_of(
    _edges(5e-324, 1e-300, 0.0, 0.5, 1.0, 1.0000001, 1e308, -1.0), st.floats(-2.0, 2.0)
)
top_ks = st.one_of(
    st.sampled_from([-2, -1, 0, 1, 2, 257, 258, 259, 2**63, 2**70]), st.integers(-3, 300)
)
seeds = st.one_of(
    st.sampled_from([-(2**63) - 1, -(2**63), -1, 0, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**64 + 1]),
    st.integers(min_value=-(2**66), max_value=2**66),
)
sampling_fields = {
    "temperature": temperatures,
    "top_p": top_ps,
    "top_k": top_ks,
    "seed": seeds,
    "max_tokens": st.one_of(st.integers(-2, 6), st.sampled_from([10**6, 2**64, 10**30])),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
}
sampling_bodies = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            st.text(min_size=1, max_size=12), st.lists(st.integers(0, 257), min_size=1, max_size=12)
        )
    },
    optional=sampling_fields,
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(sampling_bodies)
def test_any_sampling_values_get_valid_tokens_or_a_400_never_a_5xx(
    worker_port: int, body: dict[str, Any]
) -> None:
    """Every accepted value samples safely (1e-40 once killed the engine): a 200 with
    valid tokens, or a 400 naming the value; the engine never dies."""
    status, reply = post(worker_port, "/v1/completions", json.dumps(body).encode())
    if status == 400:
        assert len(error_message(reply)) >= 10
        return
    assert status == 200, (status, reply)
    if body.get("stream"):
        events = [e for e in reply.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", reply
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert all("error" not in chunk for chunk in chunks), reply
        token_ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        token_ids = reply["choices"][0]["token_ids"]
        finish = reply["choices"][0]["finish_reason"]
    assert finish in ("stop", "length")
    assert 1 <= len(token_ids) <= body.get("max_tokens", 16)
    assert all(isinstance(t, int) and 0 <= t < VOCAB_SIZE for t in token_ids)


def test_the_engine_outlived_the_sampling_fuzz(worker_port: int) -> None:
    assert_alive(worker_port)
    status, reply = post(worker_port, "/v1/completions", b'{"prompt": "ok", "max_tokens": 1}')
    assert status == 200, reply


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"prompt": "\xff\xfe"}', "not valid JSON"),
        (b"\xc3\x28" * 10, "not valid JSON"),
        (b'{"prompt": [1, 2', "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2, 3]", "JSON object"),
        (b'{"prompt": "abc", "max_tokens": "7"}', "'max_tokens' must be an integer"),
        (b'{"prompt": "abc", "max_tokens": true}', "'max_tokens' must be an integer"),
        (b'{"prompt": "abc", "stream": "yes"}', "'stream' must be true or false"),
        (b'{"max_tokens": 4}', "'prompt' must be a string or a list of token ids"),
        (b'{"prompt": [1, 2.5]}', "'prompt' must be a string or a list of token ids"),
        (b'{"prompt": [1, 999]}', "token ids must be in [0, 258)"),
        (b'{"prompt": ""}', "the prompt is empty"),
        (b'{"prompt": "abc", "max_tokens": -1}', "max_tokens must be at least 1"),
        (b'{"prompt": "abc", "temperature": -0.5}', "temperature must be >= 0"),
    ],
)
def test_bad_bodies_name_the_problem(worker_port: int, raw: bytes, words: str) -> None:
    status, reply = post(worker_port, "/v1/completions", raw)
    assert status == 400, reply
    assert words in error_message(reply)


def test_lone_surrogate_in_a_text_prompt_is_a_4xx(worker_port: int) -> None:
    """``"\\ud800"`` is valid JSON but no UTF-8 text: the tokenizer cannot encode it."""
    status, reply = post(worker_port, "/v1/completions", b'{"prompt": "a\\ud800b"}')
    assert status == 400, (status, reply)
    assert "'prompt' is not valid Unicode text" in error_message(reply)
    assert_alive(worker_port)


def test_huge_token_list_under_the_body_limit_is_rejected_with_the_cache_size(
    worker_port: int,
) -> None:
    tokens = [1] * 200_000  # 600 kB of JSON: under the body limit, far over the cache
    status, reply = post(worker_port, "/v1/completions", json.dumps({"prompt": tokens}).encode())
    assert status == 400
    message = error_message(reply)
    assert f"exceeds what this worker's KV cache can ever hold ({MAX_REQUEST_TOKENS})" in message


@pytest.mark.parametrize("size", [BODY_LIMIT_BYTES + 1, 8 * BODY_LIMIT_BYTES])
def test_oversized_bodies_get_413_and_the_limit(worker_port: int, size: int) -> None:
    body = b'{"prompt": [' + b"1," * ((size - 14) // 2) + b"1]}"
    assert len(body) >= size - 2
    status, reply = post(worker_port, "/v1/completions", body[:size])
    assert status == 413
    assert f"exceeds the worker's limit of {BODY_LIMIT_BYTES} bytes" in error_message(reply)
    assert_alive(worker_port)


def test_wrong_methods_and_paths_are_4xx(worker_port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", worker_port, timeout=REPLY_TIMEOUT_S)
    try:
        for method, path, expected in [
            ("GET", "/v1/completions", 405),
            ("POST", "/health", 405),
            ("GET", "/v1/nothing", 404),
            ("DELETE", "/v1/snapshot", 405),
        ]:
            conn.request(method, path)
            response = conn.getresponse()
            response.read()
            assert response.status == expected, (method, path)
    finally:
        conn.close()


def test_worker_survives_the_fuzzing(worker_port: int) -> None:
    status, reply = post(worker_port, "/v1/completions", b'{"prompt": "hello", "max_tokens": 2}')
    assert status == 200
    assert reply["usage"]["completion_tokens"] in (1, 2)
    assert_alive(worker_port)
