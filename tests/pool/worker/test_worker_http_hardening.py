"""The worker's HTTP API under hostile requests: killer sampling values, failing requests,
clients that leave, wrong media types, aiohttp's own errors, readiness."""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import re
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from events.tokenizer import ByteTokenizer
from pool.worker.model import DecoderModel, ModelConfig, greedy_reference
from tests.support.paths import REPO_ROOT as REPO
from tests.support.polling import wait_until
from tests.support.workers import JSON_HEADERS, TIMEOUT_S, RunningWorker
from tests.support.workers import get_body as _get
from tests.support.workers import post_json as _post
from tests.support.workers import start_worker as _start_worker
from tests.support.workers import worker_config as _config

NUM_BLOCKS = 40  # 39 usable blocks of 4 tokens
VOCAB = 258


@pytest.fixture
def worker() -> Iterator[RunningWorker]:
    running = _start_worker(_config(NUM_BLOCKS, events=None, replay=None))
    yield running
    running.stop()


Target = RunningWorker | str
"""A worker in this process, or the base URL of one in another."""


def _url(worker: Target, path: str) -> str:
    return f"{worker if isinstance(worker, str) else worker.http}{path}"


def _connection(worker: Target) -> http.client.HTTPConnection:
    host, port = _url(worker, "").removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)


def _request(
    worker: RunningWorker, method: str, path: str, body: bytes = b"", headers: Any = None
) -> tuple[int, http.client.HTTPMessage, Any]:
    conn = _connection(worker)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    return response.status, response.headers, json.loads(raw)


def _metrics(worker: Target) -> str:
    status, body = _get(_url(worker, "/metrics"))
    assert status == 200
    return body.decode()


def _metric(worker: Target, sample: str) -> float:
    """The value of one sample line, e.g. ``kvroute_worker_x_total{k="v"}``."""
    for line in _metrics(worker).splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    raise AssertionError(f"no sample {sample}")


def assert_serving(worker: RunningWorker) -> None:
    """The worker is alive, ready and completes a normal request, its cache whole."""
    body = {"prompt": "still here", "max_tokens": 2}
    status, reply = _post(_url(worker, "/v1/completions"), body)
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] in (1, 2)
    status, body = _get(_url(worker, "/health"))
    health = json.loads(body)
    assert (status, health["status"]) == (200, "ok")
    assert health["free_blocks"] == health["total_blocks"] == NUM_BLOCKS - 1
    assert _get(_url(worker, "/ready"))[0] == 200


@pytest.mark.parametrize("temperature", [1e-40, 1e-300])
def test_the_killer_request_gets_a_200_and_the_worker_serves_on(
    worker: RunningWorker, temperature: float
) -> None:
    """``temperature: 1e-40`` used to make the softmax NaN, kill the engine and the worker."""
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": temperature}
    status, reply = _post(_url(worker, "/v1/completions"), body)
    assert status == 200, reply
    tokens = reply["choices"][0]["token_ids"]
    assert len(tokens) == reply["usage"]["completion_tokens"] <= 2
    assert all(0 <= t < VOCAB for t in tokens)
    assert_serving(worker)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": 0}, None),
        ({"temperature": 2}, None),
        ({"temperature": 5e-324}, None),
        ({"temperature": 1e308}, "temperature must be at most 2.0, got 1e+308"),
        ({"temperature": -1}, "temperature must be >= 0, got -1.0"),
        ({"temperature": -1e-300}, "temperature must be >= 0"),
        ({"temperature": 10**400}, "'temperature' is out of range: got an integer of 401 digits"),
        ({"temperature": "0.5"}, "'temperature' must be a number, got '0.5'"),
        ({"temperature": [1]}, "'temperature' must be a number"),
        ({"top_p": 1}, None),
        ({"top_p": 1e-300, "temperature": 1}, None),
        ({"top_p": 0}, r"top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in (0, 1], got 1.5"),
        ({"top_p": -0.5}, r"top_p must be in (0, 1], got -0.5"),
        ({"top_p": True}, "'top_p' must be a number, got True"),
        ({"top_k": 0, "temperature": 1}, None),
        ({"top_k": -1, "temperature": 1}, None),
        ({"top_k": 1, "temperature": 1}, None),
        ({"top_k": 10**30, "temperature": 1}, None),
        ({"top_k": -2}, "top_k must be -1 or 0 (all tokens) or at least 1, got -2"),
        ({"top_k": 2.5}, "'top_k' must be an integer, got 2.5"),
        ({"seed": -1, "temperature": 1}, None),
        ({"seed": -(2**63), "temperature": 1}, None),
        ({"seed": 2**63 - 1, "temperature": 1}, None),
        ({"seed": 2**63}, "seed must be a signed 64-bit integer"),
        ({"seed": 2**64}, "got 18446744073709551616"),
        ({"seed": 2**64 + 1}, "got 18446744073709551617"),
        ({"seed": -(2**63) - 1}, "seed must be a signed 64-bit integer"),
        ({"seed": "7"}, "'seed' must be an integer, got '7'"),
        ({"max_tokens": 10**30}, "exceeds what this worker's KV cache can ever hold (156)"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"max_tokens": -(10**30)}, "max_tokens must be at least 1"),
    ],
)  # fmt: skip
def test_each_sampling_value_gets_a_200_or_a_400_naming_its_range(
    worker: RunningWorker, fields: dict[str, Any], message: str | None
) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 2, **fields}
    status, reply = _post(_url(worker, "/v1/completions"), body)
    if message is None:
        assert status == 200, reply
        assert all(0 <= t < VOCAB for t in reply["choices"][0]["token_ids"])
    else:
        assert status == 400, reply
        assert reply["error"]["type"] == "invalid_request_error"
        assert message in reply["error"]["message"]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"prompt": "x", "temperature": NaN}', "not valid JSON: NaN is not a JSON number"),
        (b'{"prompt": "x", "top_p": -Infinity}', "not valid JSON: -Infinity is not a JSON number"),
        (b'{"prompt": "x", "temperature": 1e999}', "temperature must be a finite number, got inf"),
        (b'{"prompt": "x", "top_p": 1e999}', "top_p must be in (0, 1], got inf"),
    ],
)
def test_non_finite_numbers_are_refused(worker: RunningWorker, raw: bytes, message: str) -> None:
    status, reply = _post(_url(worker, "/v1/completions"), None, raw=raw)
    assert status == 400, reply
    assert message in reply["error"]["message"]
    assert_serving(worker)


# ---------------------------------------------------------------- failing requests

POISON_PROMPT = "hi"  # the poisoned request: "hi" then the poisoned token
LONG_PROMPT = [5, 6, 7, 8, 9]


def _poisoned_token(model: DecoderModel, max_tokens: int) -> int:
    """A token that neither the long request's prompt nor its continuation contains."""
    used = set(LONG_PROMPT + greedy_reference(model, LONG_PROMPT, max_tokens))
    return next(t for t in range(200, 256) if t not in used)


@pytest.fixture(scope="module")
def poisoned_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """Weights whose embedding row of one token is NaN (a corrupt checkpoint)."""
    model = DecoderModel(ModelConfig(seed=5))
    token = _poisoned_token(model, 100)
    with torch.no_grad():
        model.embed.weight[token] = math.nan
    path = tmp_path_factory.mktemp("poisoned") / "weights.safetensors"
    model.save_safetensors(path)
    return path, token


@pytest.fixture
def poisoned_worker(poisoned_weights: tuple[Path, int]) -> Iterator[RunningWorker]:
    config = _config(NUM_BLOCKS, events=None, replay=None, weights=str(poisoned_weights[0]))
    running = _start_worker(config)
    yield running
    running.stop()


def _poisoned_body(token: int, **fields: Any) -> dict[str, Any]:
    return {"prompt": [*ByteTokenizer().encode(POISON_PROMPT), token], "max_tokens": 3, **fields}


def _read_stream(response: http.client.HTTPResponse) -> list[Any]:
    events = [e for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_that_fails_in_the_engine_gets_a_json_500_and_the_others_go_on(
    poisoned_worker: RunningWorker, poisoned_weights: tuple[Path, int], temperature: float
) -> None:
    token = poisoned_weights[1]
    clean = DecoderModel(ModelConfig(seed=5))
    # A long streamed request runs while the poisoned one arrives, fails, and leaves.
    conn = _connection(poisoned_worker)
    long_body = {"prompt": LONG_PROMPT, "max_tokens": 100, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(long_body), JSON_HEADERS)
    response = conn.getresponse()
    first = response.readline()
    assert first.startswith(b"data: ") and response.readline() == b"\n"
    url = _url(poisoned_worker, "/v1/completions")
    status, reply = _post(url, _poisoned_body(token, temperature=temperature))
    assert status == 500, reply
    assert reply["error"]["type"] == "request_failed"
    assert reply["error"]["message"].startswith(
        "this request failed in the worker's engine (sampling): SamplingError: the model "
        "produced non-finite logits"
    )
    chunks = [json.loads(first.removeprefix(b"data: ")), *_read_stream(response)]
    conn.close()
    tokens = [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
    assert tokens == greedy_reference(clean, LONG_PROMPT, 100)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    metrics = _metrics(poisoned_worker)
    assert 'kvroute_worker_request_failures_total{reason="sampling"} 1.0' in metrics
    assert 'kvroute_worker_request_failures_total{reason="forward"} 0.0' in metrics
    assert 'kvroute_worker_requests_total{finish_reason="error"} 1.0' in metrics
    assert_serving(poisoned_worker)


def test_a_streamed_request_that_fails_ends_with_an_error_event(
    poisoned_worker: RunningWorker, poisoned_weights: tuple[Path, int]
) -> None:
    conn = _connection(poisoned_worker)
    body = _poisoned_body(poisoned_weights[1], stream=True)
    conn.request("POST", "/v1/completions", json.dumps(body), JSON_HEADERS)
    response = conn.getresponse()
    assert response.status == 200  # sent before the engine ran it
    events = _read_stream(response)
    conn.close()
    assert len(events) == 1
    assert set(events[0]) == {"error"}
    assert events[0]["error"]["type"] == "request_failed"
    assert "non-finite logits" in events[0]["error"]["message"]
    assert_serving(poisoned_worker)


MEMORY_MARGIN_BYTES = 128 * 2**20
"""Address space the worker keeps for itself once warm: ample for small requests, a third
of what one attention chunk of an 8,192-token prefill allocates."""


@pytest.mark.slow
def test_a_request_that_exhausts_memory_fails_alone_while_another_streams(
    tmp_path: Path,
) -> None:
    """The worker's address space is capped (as a GPU's memory is): a huge prompt's forward
    pass cannot allocate, which fails that request, not the batch it shared, nor the worker."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_ARENA_MAX": "2"}
    args = [sys.executable, "-m", "router.cli.main", "worker", "--port", "0", "--events", "none"]
    args += ["--num-blocks", "1200", "--block-size", "16", "--torch-threads", "1", "--seed", "5"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        worker = json.loads(proc.stdout.readline())["http"]
        assert _post(_url(worker, "/v1/completions"), {"prompt": "warm", "max_tokens": 2})[0] == 200
        status_lines = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        vm_kib = int(next(line for line in status_lines if line.startswith("VmSize")).split()[1])
        limit = vm_kib * 1024 + MEMORY_MARGIN_BYTES
        resource.prlimit(proc.pid, resource.RLIMIT_AS, (limit, limit))
        conn = _connection(worker)
        long_body = {"prompt": LONG_PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(long_body), JSON_HEADERS)
        response = conn.getresponse()
        first = response.readline()
        assert first.startswith(b"data: ") and response.readline() == b"\n"
        huge = {"prompt": [7] * 17_000, "max_tokens": 1}
        status, reply = _post(_url(worker, "/v1/completions"), huge)
        assert status == 500, reply
        assert reply["error"]["type"] == "request_failed"
        assert reply["error"]["message"].startswith(
            "this request failed in the worker's engine (forward): RuntimeError:"
        )
        assert "can't allocate memory" in reply["error"]["message"]
        chunks = [json.loads(first.removeprefix(b"data: ")), *_read_stream(response)]
        conn.close()
        tokens = [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
        assert tokens == greedy_reference(DecoderModel(ModelConfig(seed=5)), LONG_PROMPT, 200)
        assert _metric(worker, 'kvroute_worker_request_failures_total{reason="forward"}') == 1.0
        health = json.loads(_get(_url(worker, "/health"))[1])
        assert health["free_blocks"] == health["total_blocks"] == 1199
        assert (
            _post(_url(worker, "/v1/completions"), {"prompt": "after", "max_tokens": 2})[0] == 200
        )
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- clients that leave


def test_a_client_that_closes_mid_body_is_a_debug_line_and_a_client_abort(
    worker: RunningWorker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pool")
    host, port = worker.http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "half a bo'
        )
    sample = 'kvroute_worker_client_aborts_total{stage="request_body"}'
    wait_until(
        lambda: _metric(worker, sample) == 1.0,
        "the client abort to be counted",
        timeout_s=TIMEOUT_S,
    )
    assert _metric(worker, 'kvroute_worker_client_aborts_total{stage="response"}') == 0.0
    assert _metric(worker, 'kvroute_worker_request_failures_total{reason="handler"}') == 0.0
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert any("client closed the connection (request_body)" in r.message for r in caplog.records)
    assert_serving(worker)


def test_a_client_that_leaves_mid_stream_is_aborted_and_its_blocks_freed(
    worker: RunningWorker, caplog: pytest.LogCaptureFixture
) -> None:
    conn = _connection(worker)
    body = {"prompt": [1, 2, 3], "max_tokens": 150, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), JSON_HEADERS)
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    conn.close()  # mid-stream: the worker notices at its next write and aborts
    sample = 'kvroute_worker_client_aborts_total{stage="response"}'
    wait_until(
        lambda: _metric(worker, sample) == 1.0,
        "the client abort to be counted",
        timeout_s=TIMEOUT_S,
    )
    wait_until(
        lambda: json.loads(_get(_url(worker, "/health"))[1])["running"] == 0,
        "the abort",
        timeout_s=TIMEOUT_S,
    )
    assert 'kvroute_worker_requests_total{finish_reason="abort"} 1.0' in _metrics(worker)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert_serving(worker)


# ---------------------------------------------------------------- media types and errors


ONE_TOKEN = b'{"prompt": "a", "max_tokens": 1}'


@pytest.mark.parametrize(
    ("path", "body", "content_type", "status"),
    [
        ("/v1/completions", ONE_TOKEN, "text/plain", 415),
        ("/v1/completions", ONE_TOKEN, "application/x-www-form-urlencoded", 415),
        ("/v1/completions", ONE_TOKEN, "multipart/form-data; boundary=x", 415),
        ("/v1/completions", ONE_TOKEN, None, 415),
        ("/v1/completions", ONE_TOKEN, "application/octet-stream", 415),
        ("/v1/completions", ONE_TOKEN, "application/json; charset=latin-1", 415),
        ("/v1/completions", ONE_TOKEN, "application/json", 200),
        ("/v1/completions", ONE_TOKEN, "Application/JSON; charset=UTF-8", 200),
        ("/v1/reset_prefix_cache", b"", None, 200),
        ("/v1/reset_prefix_cache", b"", "application/octet-stream", 200),  # aiohttp's default
        ("/v1/reset_prefix_cache", b"", "application/json", 200),
        ("/v1/reset_prefix_cache", b"", "text/plain", 415),  # a cross-site form
        ("/v1/reset_prefix_cache", b"", "application/x-www-form-urlencoded", 415),
    ],
)  # fmt: skip
def test_post_bodies_must_be_json(
    worker: RunningWorker, path: str, body: bytes, content_type: str | None, status: int
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    if body and content_type is None:
        headers["Content-Length"] = str(len(body))
    code, _, reply = _request(worker, "POST", path, body, headers)
    assert code == status, reply
    if status == 415:
        assert reply["error"]["type"] == "unsupported_media_type"
        wanted = "'Content-Type: application/json'|must be UTF-8"
        assert re.search(wanted, reply["error"]["message"])


def test_aiohttp_errors_come_back_as_openai_json(worker: RunningWorker) -> None:
    status, headers, reply = _request(worker, "GET", "/v1/completions")
    assert status == 405
    assert headers["Allow"] == "POST"
    assert reply == {
        "error": {
            "message": "GET is not allowed on /v1/completions; use POST",
            "type": "method_not_allowed",
        }
    }
    status, _, reply = _request(worker, "DELETE", "/v1/snapshot")
    assert (status, reply["error"]["type"]) == (405, "method_not_allowed")
    status, _, reply = _request(worker, "GET", "/v1/nothing")
    assert reply == {"error": {"message": "no endpoint /v1/nothing", "type": "not_found"}}
    assert status == 404
    status, _, reply = _request(worker, "POST", "/v1/nothing", b"{}", JSON_HEADERS)
    assert (status, reply["error"]["type"]) == (404, "not_found")
