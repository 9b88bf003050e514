"""The worker over real HTTP on 127.0.0.1 and real ZeroMQ: completions, events, snapshot, drain."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from events.curve import (
    CurveClientConfig,
    CurveKeyPair,
    configure_client,
    load_public_key,
    write_keypair,
)
from events.framing import END_OF_REPLAY_SEQ, pack_seq, parse_message, unpack_seq
from events.hashing import hash_blocks_sha256_cbor, wire_hash
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from events.tokenizer import ByteTokenizer
from pool.snapshot import CachedChains
from pool.worker.config import config_from_args
from pool.worker.flags import build_parser
from pool.worker.model import DecoderModel, ModelConfig, greedy_reference
from tests.support.paths import REPO_ROOT
from tests.support.workers import BLOCK_SIZE, JSON_HEADERS, TIMEOUT_S, RunningWorker
from tests.support.workers import get_body as _get
from tests.support.workers import post_json as _post
from tests.support.workers import start_worker as _start_worker
from tests.support.workers import worker_config as _config

# vLLM 0.33's consumers decode with a typed msgspec decoder: the strictest reading.
STRICT = msgspec.msgpack.Decoder(KVEventBatch)


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[RunningWorker]:
    running = _start_worker(_config(20))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel(ModelConfig(seed=5))


def _complete(worker: RunningWorker, prompt: object, max_tokens: int = 4) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    status, reply = _post(f"{worker.http}/v1/completions", body)
    assert status == 200, reply
    return dict(reply)


class EventTap:
    """A SUB socket on the worker's events, completed by replay from seq 0.

    The handshake against the slow-joiner problem: probe requests are sent until a live
    batch arrives; everything before that batch is then fetched through replay.
    """

    def __init__(self, worker: RunningWorker, curve: CurveClientConfig | None = None) -> None:
        self.ctx = zmq.Context()
        self.worker = worker
        self.curve = curve
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.linger = 0
        if curve is not None:
            configure_client(self.sub, curve)
        self.sub.subscribe(b"kv")
        self.sub.connect(worker.events)
        self.batches: dict[int, KVEventBatch] = {}

    def handshake(self) -> None:
        for attempt in range(200):
            _complete(self.worker, f"probe {attempt:04d} ..", max_tokens=1)
            if self.sub.poll(100):
                self._take_live()
                break
        else:
            raise AssertionError("no live event batch arrived")
        self._replay_from(0)

    def _take_live(self) -> int:
        topic, seq, payload = parse_message(self.sub.recv_multipart())
        assert topic == b"kv"
        self.batches[seq] = STRICT.decode(payload)
        return seq

    def _replay_from(self, start: int) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.linger = 0
        if self.curve is not None:
            configure_client(dealer, self.curve)
        dealer.connect(self.worker.replay)
        dealer.send_multipart([b"", pack_seq(start)])
        while True:
            assert dealer.poll(int(TIMEOUT_S * 1000)), "replay timed out"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY_SEQ:
                break
            assert topic == b"kv"
            self.batches.setdefault(unpack_seq(seq), STRICT.decode(payload))
        dealer.close()

    def until(self, next_seq: int) -> list[object]:
        """Every event of batches ``0 .. next_seq - 1``, live, in seq order."""
        while len(self.batches) < next_seq:
            assert self.sub.poll(int(TIMEOUT_S * 1000)), "live event batch timed out"
            self._take_live()
        assert sorted(self.batches) == list(range(len(self.batches)))
        return [e for seq in range(next_seq) for e in self.batches[seq].events]

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()


@pytest.fixture
def tap(worker: RunningWorker) -> Iterator[EventTap]:
    events = EventTap(worker)
    events.handshake()
    yield events
    events.close()


def _snapshot(worker: RunningWorker) -> dict[str, Any]:
    status, body = _get(f"{worker.http}/v1/snapshot")
    assert status == 200
    return dict(json.loads(body))


def test_repeated_prefix_raises_cached_tokens_and_events_carry_vllm_hashes(
    worker: RunningWorker, tap: EventTap, model: DecoderModel
) -> None:
    prompt = "The quick brown fox jumps"  # 25 bytes: 6 full blocks
    first = _complete(worker, prompt)
    second = _complete(worker, prompt + " over")
    tokens = ByteTokenizer().encode(prompt)
    assert first["usage"] == {
        "prompt_tokens": 25,
        "completion_tokens": 4,
        "total_tokens": 29,
        "cached_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert second["usage"]["cached_tokens"] == 24
    assert first["choices"][0]["token_ids"] == greedy_reference(model, tokens, 4)
    assert first["choices"][0]["text"] == ByteTokenizer().decode(first["choices"][0]["token_ids"])
    assert first["choices"][0]["finish_reason"] == "length"

    events = tap.until(_snapshot(worker)["next_seq"])
    all_tokens = tokens + first["choices"][0]["token_ids"]
    digests = hash_blocks_sha256_cbor(all_tokens, BLOCK_SIZE)
    ours = {wire_hash(d) for d in digests}
    stored = [e for e in events if isinstance(e, BlockStored) and e.block_hashes[0] in ours]
    assert stored[0].block_hashes == [wire_hash(d) for d in digests[:6]]
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == tokens[:24]
    # The generated tokens complete block 6, cached at the next decode step.
    assert stored[1].block_hashes == [wire_hash(digests[6])]
    assert stored[1].parent_block_hash == wire_hash(digests[5])
    assert stored[1].token_ids == all_tokens[24:28]


def test_pressure_evicts_reset_clears_and_snapshot_matches_events(
    worker: RunningWorker, tap: EventTap
) -> None:
    # 19 usable blocks of 4 tokens: distinct 40-byte prompts force evictions.
    for i in range(6):
        _complete(worker, f"{i:02d}" * 20)
    snap = _snapshot(worker)
    events = tap.until(snap["next_seq"])
    assert any(isinstance(e, BlockRemoved) for e in events)
    implied = CachedChains(BLOCK_SIZE)
    implied.apply(events)  # type: ignore[arg-type]
    assert snap["runs"] == implied.runs()
    assert snap["block_size"] == BLOCK_SIZE
    assert (snap["worker_id"], snap["hash_algo"], snap["medium"]) == (
        "w-test",
        "sha256_cbor",
        "GPU",
    )

    status, reply = _post(f"{worker.http}/v1/reset_prefix_cache", None, raw=b"")
    assert (status, reply) == (200, {"success": True})
    after = _snapshot(worker)
    assert after["runs"] == []
    events = tap.until(after["next_seq"])
    assert isinstance(events[-1], AllBlocksCleared)
    again = _complete(worker, f"{5:02d}" * 20)
    assert again["usage"]["cached_tokens"] == 0


@pytest.mark.slow
def test_concurrent_requests_under_pressure_equal_no_cache_reference(
    worker: RunningWorker, model: DecoderModel
) -> None:
    shared = "system: you are a helpful assistant. "
    # 7 to 19 tokens each, 10 generated: a few run at once and outgrow the 19 blocks, so
    # requests queue, get preempted and recomputed, and evict each other's prefixes.
    prompts = [shared[: 4 * (i % 4)] + f"u{i}?" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: _complete(worker, p, max_tokens=10), prompts))
    tokenizer = ByteTokenizer()
    for prompt, reply in zip(prompts, replies, strict=True):
        expected = greedy_reference(model, tokenizer.encode(prompt), 10)
        assert reply["choices"][0]["token_ids"] == expected, prompt
    status, body = _get(f"{worker.http}/metrics")
    metrics = body.decode()
    assert status == 200
    assert 'kvroute_worker_requests_total{finish_reason="length"} 8.0' in metrics
    assert "kvroute_worker_free_blocks 19.0" in metrics


def test_streaming_sends_one_chunk_per_token_then_done(
    worker: RunningWorker, model: DecoderModel
) -> None:
    host, port = worker.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 5, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), JSON_HEADERS)
    response = conn.getresponse()
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream"
    lines = [line for line in response.read().decode().split("\n\n") if line]
    conn.close()
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [
        [t] for t in greedy_reference(model, [5, 6, 7, 8, 9], 5)
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    # No usage in a stream unless stream_options.include_usage asks for it.
    assert not any("usage" in c for c in chunks)


def test_health_reports_load(worker: RunningWorker) -> None:
    status, body = _get(f"{worker.http}/health")
    assert status == 200
    health = json.loads(body)
    # The publisher lifetime id: random per process, the same in /v1/snapshot.
    assert re.fullmatch("[0-9a-f]{32}", health.pop("lifetime_id"))
    assert _snapshot(worker)["lifetime_id"] == json.loads(body)["lifetime_id"]
    # The publisher's next seq: the snapshot's, as no request ran in between.
    assert health.pop("next_seq") == _snapshot(worker)["next_seq"]
    assert health == {
        "status": "ok",
        "worker_id": "w-test",
        "running": 0,
        "waiting": 0,
        "free_blocks": 19,
        "total_blocks": 19,
        "usage": 0.0,
        "queued_prefill_tokens": 0,
        "decode_tokens": 0,
    }


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        (b"{bad", 400, "the body is not valid JSON"),
        (b"[1, 2]", 400, "the body must be a JSON object"),
        (b'{"prompt": ""}', 400, "the prompt is empty"),
        (b'{"prompt": 5}', 400, "'prompt' must be a string or a list of token ids"),
        (b'{"prompt": [1, "a"]}', 400, "'prompt' must be a string or a list of token ids"),
        (b'{"prompt": "hi", "max_tokens": -2}', 400, "max_tokens must be at least 1, got -2"),
        (b'{"prompt": "hi", "max_tokens": "3"}', 400, "'max_tokens' must be an integer"),
        (b'{"prompt": "hi", "stream": 1}', 400, "'stream' must be true or false"),
        (b'{"prompt": "hi", "temperature": "hot"}', 400, "'temperature' must be a number"),
        (b'{"prompt": [1, 999]}', 400, r"token ids must be in [0, 258)"),
        (b'{"prompt": "' + b"x" * 80 + b'"}', 400, "exceeds what this worker's KV cache"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_the_worker_keeps_serving(
    worker: RunningWorker, raw: bytes, status: int, message: str
) -> None:
    code, reply = _post(f"{worker.http}/v1/completions", None, raw=raw)
    assert code == status
    assert message in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"
    assert _complete(worker, "still here", max_tokens=1)["usage"]["completion_tokens"] == 1


@pytest.mark.slow
def test_cli_worker_drains_on_sigterm(tmp_path: Path, model: DecoderModel) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    args = [sys.executable, "-m", "router.cli.main", "worker", "--port", "0", "--events", "none"]
    args += ["--num-blocks", "64", "--block-size", "4", "--seed", "5", "--id", "cli-w"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["worker_id"] == "cli-w"
        assert ready["events"] is None
        host, port = ready["http"].removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
        body = {"prompt": [1, 2, 3], "max_tokens": 40, "stream": True, "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), JSON_HEADERS)
        response = conn.getresponse()
        first = response.readline()  # the request is running: now ask the worker to stop
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        rest = (first + response.read()).decode()
        chunks = [json.loads(c.removeprefix("data: ")) for c in rest.split("\n\n")[:-2]]
        tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert tokens == greedy_reference(model, [1, 2, 3], 40)
        assert rest.endswith("data: [DONE]\n\n")
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"draining" in proc.stderr.read()  # type: ignore[union-attr]


def test_curve_secured_events_reach_an_allowed_subscriber(tmp_path: Path) -> None:
    server_public, server_secret = write_keypair(tmp_path / "keys", "worker")
    client_public, client_secret = write_keypair(tmp_path / "keys", "router")
    config = _config(20, curve_secret_key=str(server_secret), curve_allow=str(client_public))
    running = _start_worker(config)
    tap = EventTap(
        running, CurveClientConfig(load_public_key(server_public), CurveKeyPair.load(client_secret))
    )
    try:
        tap.handshake()
        first = _complete(running, "secured prefix!!", max_tokens=1)
        events = tap.until(_snapshot(running)["next_seq"])
        assert first["usage"]["prompt_tokens"] == 16
        tokens = ByteTokenizer().encode("secured prefix!!")
        hashes = [wire_hash(d) for d in hash_blocks_sha256_cbor(tokens, BLOCK_SIZE)]
        assert any(isinstance(e, BlockStored) and e.block_hashes == hashes for e in events)
    finally:
        tap.close()
        running.stop()


def test_a_client_that_goes_away_aborts_its_request(worker: RunningWorker) -> None:
    host, port = worker.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    body = {"prompt": [1, 2, 3], "max_tokens": 70, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), JSON_HEADERS)
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    conn.close()  # mid-stream: the worker notices at its next write and aborts
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        health = json.loads(_get(f"{worker.http}/health")[1])
        if health["running"] == 0:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.05)  # polling another process's state over HTTP; nothing to wait on
    assert health["free_blocks"] == 19
    metrics = _get(f"{worker.http}/metrics")[1].decode()
    assert 'kvroute_worker_requests_total{finish_reason="abort"} 1.0' in metrics


def test_worker_serves_safetensors_weights_with_a_tokenizer_json(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[UNK]", "</s>", *(f"w{i}" for i in range(38))]
    hf = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_special_tokens(["</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    trained = DecoderModel(ModelConfig(vocab_size=40, seed=9))
    trained.save_safetensors(tmp_path / "weights.safetensors")
    config = _config(
        20,
        events=None,
        replay=None,
        weights=str(tmp_path / "weights.safetensors"),
        tokenizer=str(tmp_path / "tokenizer.json"),
    )
    running = _start_worker(config)
    try:
        reply = _complete(running, "w3 w1 w4 w1 w5", max_tokens=5)
    finally:
        running.stop()
    expected = greedy_reference(trained, [5, 3, 6, 3, 7], 5)
    assert reply["choices"][0]["token_ids"] == expected
    assert reply["choices"][0]["text"] == " ".join(words[t] for t in expected if t != 1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "gpu0"], "--device 'gpu0' is not a torch device"),
        (["--hidden-size", "63"], "hidden_size 63 must split into 4 heads"),
        (["--curve-allow", "x.key"], "--curve-allow needs --curve-secret-key"),
        # "cannot load tokenizer file", or "needs the 'tokenizers' library" without it
        (["--tokenizer", "/nonexistent/tokenizer.json"], "tokenizer"),
    ],
)
def test_cli_errors_exit_1_with_a_clear_message(
    flags: list[str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    from pool.worker.cli import main

    assert main(["--port", "0", "--events", "none", *flags]) == 1
    assert "worker failed: " in caplog.text
    assert message in caplog.text


def test_chunked_prefill_streams_a_prompt_s_blocks_over_several_batches(
    model: DecoderModel,
) -> None:
    running = _start_worker(_config(20, max_num_batched_tokens=8))
    tap = EventTap(running)
    try:
        tap.handshake()
        tokens = ByteTokenizer().encode("a prompt of 26 bytes here!")
        reply = _complete(running, "a prompt of 26 bytes here!", max_tokens=2)
        events = tap.until(_snapshot(running)["next_seq"])
    finally:
        tap.close()
        running.stop()
    assert reply["choices"][0]["token_ids"] == greedy_reference(model, tokens, 2)
    hashes = [wire_hash(d) for d in hash_blocks_sha256_cbor(tokens, BLOCK_SIZE)]
    ours = [e for e in events if isinstance(e, BlockStored) and e.block_hashes[0] in hashes]
    # 8-token chunks: blocks 0-1, 2-3, 4-5 are stored by three steps, each chained.
    assert [e.block_hashes for e in ours] == [hashes[0:2], hashes[2:4], hashes[4:6]]
    assert [e.parent_block_hash for e in ours] == [None, hashes[1], hashes[3]]
    assert [e.token_ids for e in ours] == [tokens[0:8], tokens[8:16], tokens[16:24]]


def test_a_body_over_max_body_bytes_gets_a_json_413_naming_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVROUTE_WORKER_MAX_BODY_BYTES", "4096")
    args = build_parser().parse_args([])
    assert args.max_body_bytes == 4096
    assert build_parser().parse_args(["--max-body-bytes", "9"]).max_body_bytes == 9
    running = _start_worker(_config(200, max_body_bytes=config_from_args(args).max_body_bytes))
    try:
        over = json.dumps({"prompt": [7] * 2000, "max_tokens": 1}).encode()
        assert len(over) > 4096
        code, reply = _post(f"{running.http}/v1/completions", None, raw=over)
        assert code == 413
        assert reply["error"]["type"] == "request_too_large"
        assert "limit of 4096 bytes" in reply["error"]["message"]
        assert "--max-body-bytes" in reply["error"]["message"]
        under = {"prompt": [7] * 500, "max_tokens": 1, "ignore_eos": True}
        assert len(json.dumps(under)) < 4096
        code, reply = _post(f"{running.http}/v1/completions", under)
        assert code == 200, reply
        assert reply["usage"]["prompt_tokens"] == 500
    finally:
        running.stop()


def test_the_request_id_is_echoed_and_ends_the_completion_id(worker: RunningWorker) -> None:
    def ask(request_id: str | None, path: str = "/v1/completions") -> tuple[str | None, str]:
        headers = dict(JSON_HEADERS)
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        body = json.dumps({"prompt": "id", "max_tokens": 1}).encode()
        request = urllib.request.Request(f"{worker.http}{path}", data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return response.headers.get("X-Request-Id"), json.loads(response.read())["id"]
        except urllib.error.HTTPError as exc:  # errors carry it too
            return exc.headers.get("X-Request-Id"), ""

    echoed, completion_id = ask("router-chose-this 1")
    assert echoed == "router-chose-this 1"
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}-router-chose-this 1", completion_id)
    echoed, completion_id = ask(None)
    assert echoed is None and re.fullmatch(r"cmpl-[0-9a-f]{32}", completion_id)
    echoed, completion_id = ask("x" * 129)  # unusable: ignored, never echoed
    assert echoed is None and re.fullmatch(r"cmpl-[0-9a-f]{32}", completion_id)
    assert ask("e1", "/no-such-path") == ("e1", "")
