"""The router's HTTP API in process: real Redis, real aiohttp workers, real HTTP clients."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from events.curve import CurveKeyPair
from events.identity import WorkerId
from events.subscriber import SubscriberError
from router.front.config import RequestLimits
from router.front.service import RouterService
from router.front.tokenization import TokenizerSources
from router.offline.explain import read_decisions
from router.routing.policies import POLICY_NAMES
from router.store.server import RedisServer
from router.workers.registry import WorkerRecord
from tests.support.router_app import EchoWorker, Scenario, post, run, saved_ids

BAD_BODIES = [
    (b"{not json", 400, "request body is not valid JSON"),
    (b"", 400, "request body is empty"),
    (b"[1, 2]", 400, "invalid request body: Expected `object`, got `array`"),
    (b'{"max_tokens": 3}', 400, "invalid request body: Object missing required field `prompt`"),
    (
        b'{"prompt": 7}',
        400,
        "invalid request body: Expected `str | array`, got `int` - at `$.prompt`",
    ),
    (b'{"prompt": "a", "max_tokens": -1}', 400, "Expected `int` >= 0 - at `$.max_tokens`"),
    (b'{"prompt": "a", "stream": "yes"}', 400, "Expected `bool | null`, got `str` - at `$.stream`"),
    (b'{"prompt": [1, -2]}', 400, "Expected `int` >= 0 - at `$.prompt[1]`"),
    (b'{"prompt": [4294967296]}', 400, "Expected `int` <= 4294967295 - at `$.prompt[0]`"),
    (b'{"prompt": ""}', 400, "prompt is empty"),
    (b'{"prompt": []}', 400, "prompt is empty"),
    (b'{"prompt": "\\ud800"}', 400, "request body is not valid JSON"),  # lone surrogate
    (b'{"prompt": "' + b"x" * 101 + b'"}', 400, "prompt has 101 tokens; the limit is 100"),
    (b'{"prompt": "a", "max_tokens": 1001}', 400, "max_tokens 1001 exceeds the limit 1000"),
    (b'{"prompt": "' + b"x" * 5000 + b'"}', 413, "request body exceeds the limit of 4096 bytes"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/route"])
def test_bad_bodies_get_a_4xx_with_a_clear_message(
    redis_url: str, namespace: str, path: str
) -> None:
    async def scenario(svc: RouterService, client: aiohttp.ClientSession, _: Any) -> None:
        for body, code, message in BAD_BODIES:
            status, answer = await post(client, path, body)
            assert (status, answer["error"]["type"]) == (code, "invalid_request_error"), body
            assert message in answer["error"]["message"], (body, answer)
        # The router is unharmed.
        status, _ = await post(client, path, {"prompt": "fine"})
        assert status == 200

    limits = RequestLimits(max_body_bytes=4096, max_prompt_tokens=100, max_output_tokens=1000)
    run(redis_url, namespace, scenario, limits=limits)


def test_route_answers_the_documented_shape_and_dry_run_records_nothing(
    redis_url: str, namespace: str
) -> None:
    prompt = "s" * 64  # four 16-token blocks with the byte tokenizer

    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        status, dry = await post(client, "/v1/route", {"prompt": prompt, "dry_run": True})
        assert status == 200
        assert list(dry) == ["worker_id", "url", "matched_tokens", "candidates", "num_candidates"]
        assert dry["url"] == {w.worker_id: w.url for w in ws}[dry["worker_id"]]
        assert dry["matched_tokens"] == 0
        assert [sorted(c) for c in dry["candidates"]] == [
            ["load", "matched_tokens", "predicted_tokens", "score", "worker_id"]
        ] * 2
        assert sorted(c["worker_id"] for c in dry["candidates"]) == ["w0", "w1"]
        idle = {"num_requests": 0, "queued_prefill_tokens": 0, "decode_tokens": 0}
        assert all(c["load"] == idle and c["predicted_tokens"] == 0 for c in dry["candidates"])
        # A dry run left no predicted entry and no load behind.
        _, again = await post(client, "/v1/route", {"prompt": prompt, "dry_run": True})
        def by_worker(answer: dict[str, Any]) -> list[dict[str, Any]]:
            return sorted(answer["candidates"], key=lambda c: c["worker_id"])

        assert by_worker(again) == by_worker(dry)  # (listed best first: ties in any order)
        # A real decision credits its worker with the prefix and counts as its load.
        _, real = await post(client, "/v1/route", {"prompt": prompt, "max_tokens": 8})
        chosen = real["worker_id"]
        _, after = await post(client, "/v1/route", {"prompt": prompt, "dry_run": True})
        by_id = {c["worker_id"]: c for c in after["candidates"]}
        assert by_id[chosen]["predicted_tokens"] == 64
        assert by_id[chosen]["matched_tokens"] == 0  # no event confirmed it
        assert by_id[chosen]["load"]["num_requests"] == 1
        assert by_id[chosen]["load"]["decode_tokens"] == 8
        assert after["worker_id"] == chosen  # the sibling follows its prefix
        metrics = await (await client.get("/metrics")).text()
        assert (
            f'kvroute_router_decisions_total{{policy="cache_aware",worker="{chosen}"}} 1.0'
            in metrics
        )

    run(redis_url, namespace, scenario)


def test_completions_are_proxied_and_siblings_follow_their_prefix(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    log = tmp_path / "decisions.jsonl"

    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        served = []
        for i in range(4):
            async with client.post("/v1/completions", json={"prompt": "p" * 48 + str(i)}) as resp:
                assert resp.status == 200
                served.append(resp.headers["X-Kvroute-Worker"])
                body = await resp.json()
                assert body["choices"][0]["text"].startswith(served[-1] + ":")
        assert len(set(served)) == 1  # predicted entries keep siblings together
        assert sum(len(w.prompts) for w in ws) == 4
        records = read_decisions(log)  # the format `kvroute explain --decisions` reads
        assert [r.worker_id for r in records] == served
        assert all(r.policy == "cache_aware" and r.num_prompt_tokens == 49 for r in records)
        assert [sorted(c.worker_id for c in r.candidates) for r in records] == [["w0", "w1"]] * 4
        assert records[1].candidates[0].load.num_requests == 0  # sequential: idle at decision
        # Load is released when each request finishes.
        snap = await svc.load.snapshot([w.record().worker_id for w in ws])  # type: ignore[arg-type]
        assert all(load.num_requests == 0 for load in snap.values())

    run(redis_url, namespace, scenario, decision_log=str(log))


def test_chat_is_forwarded_as_sent_and_keyed_with_the_builtin_or_a_hugging_face_template(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "</s>"},
                "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] "
                "{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}",
            }
        )
    )
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    # Fields the router does not know reach the worker too: the body is forwarded as sent.
    raw = json.dumps(
        {"messages": messages, "max_tokens": 3, "temperature": 0.5, "vendor_knob": [1, 2.50]},
        indent=1,
    ).encode()

    def scenario(log: Path, expected_prompt: str) -> Scenario:
        async def check(
            svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
        ) -> None:
            status, answer = await post(client, "/v1/chat/completions", raw)
            assert status == 200
            assert answer["object"] == "chat.completion"
            assert [b for w in ws for b in w.bodies] == [("/v1/chat/completions", raw)]
            # Keyed from the template's rendering (text parts joined by newlines, as vLLM).
            (decision,) = read_decisions(log)
            assert decision.num_prompt_tokens == len(expected_prompt.encode())
            status, err = await post(client, "/v1/chat/completions", {"messages": []})
            assert (status, err["error"]["message"]) == (
                400,
                "messages is empty: send at least one message",
            )
            status, err = await post(
                client, "/v1/chat/completions", {"messages": [{"content": "x"}]}
            )
            assert (status, err["error"]["message"]) == (400, "messages[0] has no string 'role'")

        return check

    builtin = "<|system|>\nbe brief\n<|user|>\nh\ni\n<|assistant|>\n"
    run(redis_url, namespace, scenario(tmp_path / "a.jsonl", builtin),
        decision_log=str(tmp_path / "a.jsonl"))  # fmt: skip
    hf = "<s>[system] be brief\n[user] h\ni\n[assistant] "
    run(
        redis_url, namespace, scenario(tmp_path / "b.jsonl", hf),
        decision_log=str(tmp_path / "b.jsonl"),
        tokenizers=TokenizerSources(chat_template=str(config)),
    )  # fmt: skip


def test_workers_can_be_listed_added_and_removed(redis_url: str, namespace: str) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        async with client.get("/v1/workers") as resp:
            listed = (await resp.json())["workers"]
        assert [w["worker_id"] for w in listed] == ["w0"]
        # One id names the replica: the lease it holds and its shared load.
        assert await svc.registry.holder(WorkerId("w0")) == f"1:{svc.load.replica_id}"
        assert sorted(listed[0]) == [
            "block_size",
            "block_size_mismatch",
            "circuit",
            "events",
            "events_block_size",
            "kind",
            "models",
            "replay",
            "server_key",
            "topic",
            "url",
            "worker_id",
        ]
        new = {"worker_id": "w9", "url": ws[0].url, "events": "tcp://127.0.0.1:1", "replay": None,
               "topic": "kv", "block_size": 32}  # fmt: skip
        status, added = await post(client, "/v1/workers", new)
        assert status == 201
        assert added == {
            "worker": {**new, "kind": "kvroute", "server_key": None, "models": None},
            "outcome": "created",
        }
        async with client.get("/v1/workers") as resp:
            assert [w["worker_id"] for w in (await resp.json())["workers"]] == ["w0", "w9"]
        # The same registration again is idempotent: 200, nothing created.
        assert await post(client, "/v1/workers", new) == (200, {**added, "outcome": "unchanged"})
        # The same id on other endpoints is a conflict, not a silent replacement.
        moved = {**new, "events": "tcp://127.0.0.1:2", "topic": "kv2"}  # restarted elsewhere
        status, conflict = await post(client, "/v1/workers", moved)
        assert status == 409
        assert conflict["error"]["type"] == "conflict"
        assert conflict["error"]["differences"] == {
            "events": {"saved": "tcp://127.0.0.1:1", "requested": "tcp://127.0.0.1:2"},
            "topic": {"saved": "kv", "requested": "kv2"},
        }
        assert "send PUT /v1/workers/w9" in conflict["error"]["message"]
        assert [r.topic for r in await svc.registry.records() if r.worker_id == "w9"] == ["kv"]
        # PUT replaces it explicitly.
        async with client.put("/v1/workers/w9", json=moved) as resp:
            assert resp.status == 200
            assert await resp.json() == {
                "worker": {**moved, "kind": "kvroute", "server_key": None, "models": None},
                "outcome": "replaced",
            }
        async with client.put("/v1/workers/other", json=moved) as resp:
            assert resp.status == 400
            assert "differs from 'other' in the path" in (await resp.json())["error"]["message"]
        async with client.get("/v1/workers") as resp:
            listed = (await resp.json())["workers"]
        assert [(w["worker_id"], w["topic"]) for w in listed] == [("w0", ""), ("w9", "kv2")]
        # A CURVE-secured worker: its z85 public key is persisted with the registration.
        server_key = CurveKeyPair.generate().public_key.decode()
        secured = {**new, "worker_id": "w8", "server_key": server_key}
        assert await post(client, "/v1/workers", secured) == (
            201,
            {"worker": {**secured, "kind": "kvroute", "models": None}, "outcome": "created"},
        )
        assert {r.worker_id: r.server_key for r in await svc.registry.records()} == {
            "w0": None,
            "w8": server_key,
            "w9": None,
        }
        async with client.delete("/v1/workers/w8") as resp:
            assert resp.status == 200
        for bad, message in [
            ({**new, "colour": "red"}, "Object contains unknown field `colour`"),
            ({"worker_id": "x", "url": ws[0].url}, "Object missing required field `events`"),
            ({**new, "worker_id": "a b"}, "worker id 'a b' is not valid"),
            ({**new, "url": "ftp://x"}, "must start with http:// or https://"),
            ({**new, "block_size": 0}, "block_size must be 1-4096 tokens"),
            ({**new, "server_key": "short"}, "server_key must be a z85 CURVE public key of 40"),
        ]:
            status, err = await post(client, "/v1/workers", bad)
            assert status == 400 and message in err["error"]["message"], (bad, err)
        async with client.delete("/v1/workers/w9") as resp:
            assert (resp.status, await resp.json()) == (200, {"removed": "w9"})
        async with client.delete("/v1/workers/w9") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["message"] == "worker 'w9' is not registered"
        async with client.get("/nowhere") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["type"] == "invalid_request_error"

    run(redis_url, namespace, scenario, n=1)


def test_no_workers_is_a_clear_503(redis_url: str, namespace: str) -> None:
    async def scenario(svc: RouterService, client: aiohttp.ClientSession, _: Any) -> None:
        status, err = await post(client, "/v1/completions", {"prompt": "x"})
        assert status == 503
        assert err["error"] == {
            "message": "no worker with an HTTP URL is registered: add one with POST /v1/workers",
            "type": "no_workers",
        }

    run(redis_url, namespace, scenario, n=0)


@pytest.mark.slow
def test_redis_outage_degrades_to_load_routing_and_recovers(private_redis: RedisServer) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        async with client.get("/health") as resp:
            assert (await resp.json())["index"] == "live"
        private_redis.stop()
        served = []
        for i in range(6):
            status, body = await post(client, "/v1/completions", {"prompt": f"q{i}" * 20})
            assert status == 200, body
            served.append(body["choices"][0]["text"].split(":")[0])
        async with client.get("/health") as resp:
            health = await resp.json()
            assert resp.status == 200
        assert (health["status"], health["index"]) == ("degraded", "degraded")
        metrics = await (await client.get("/metrics")).text()
        assert "kvroute_router_index_live 0.0" in metrics
        assert 'kvroute_router_index_errors_total{operation="lookup"}' in metrics
        private_redis.start()  # same port, empty: the ingest registers and rebuilds
        deadline = time.monotonic() + 30
        while True:
            _, _ = await post(client, "/v1/route", {"prompt": "probe" * 10, "dry_run": True})
            async with client.get("/health") as resp:
                if (await resp.json())["index"] == "live":
                    break
            assert time.monotonic() < deadline, "index did not come back"
            await asyncio.sleep(0.1)  # polling recovery with a deadline
        assert sorted(set(served)) == ["w0", "w1"]  # load-based routing spread the work

    run(private_redis.url, "degraded", scenario, probe_interval_s=0.2)


@pytest.mark.slow
def test_router_runs_on_a_redis_cluster(redis_cluster_url: str, namespace: str) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        status, body = await post(client, "/v1/completions", {"prompt": "cluster" * 10})
        assert status == 200
        assert body["choices"][0]["text"] in ("w0:1", "w1:1")  # proxied to one echo worker
        status, route = await post(client, "/v1/route", {"prompt": "cluster" * 10, "dry_run": True})
        assert status == 200
        assert sorted(c["worker_id"] for c in route["candidates"]) == ["w0", "w1"]
        async with client.get("/health") as resp:
            health = await resp.json()
        assert (health["index"], health["shared_load"]) == ("live", "live")

    run(redis_cluster_url, namespace, scenario)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_routes_and_proxies(redis_url: str, namespace: str, policy: str) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        chosen = []
        for i in range(4):
            status, route = await post(client, "/v1/route", {"prompt": f"{i}" * 40})
            assert status == 200 and route["worker_id"] in ("w0", "w1", "w2")
            chosen.append(route["worker_id"])
            status, body = await post(client, "/v1/completions", {"prompt": f"{i}" * 40})
            assert status == 200 and body["choices"][0]["text"][:2] in ("w0", "w1", "w2")
        metrics = await (await client.get("/metrics")).text()
        assert (
            f'kvroute_router_decisions_total{{policy="{policy}",worker="{chosen[0]}"}}' in metrics
        )
        if policy == "round_robin":
            assert len(set(chosen)) == 3

    run(redis_url, namespace, scenario, n=3, policy=policy)


def test_bad_registrations_are_refused_whole_and_leave_nothing_behind(
    redis_url: str, namespace: str
) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        good = {"worker_id": "w9", "url": ws[0].url, "events": "tcp://127.0.0.1:1"}
        for change, message in [
            ({"events": "garbage"}, "events endpoint 'garbage': expected tcp://HOST:PORT"),
            ({"replay": "garbage"}, "replay endpoint 'garbage': expected tcp://HOST:PORT"),
            ({"events": "tcp://*:5557"}, "'*' is a wildcard (a bind address)"),
            ({"events": "tcp://0.0.0.0:5557"}, "'0.0.0.0' is a wildcard"),
            ({"events": "inproc://w9"}, "inproc:// reaches only sockets inside the router"),
            ({"url": "http://"}, "url 'http://': the host is empty"),
            ({"url": "http://127.0.0.1:99999"}, "Port out of range"),
            ({"url": "ftp://x"}, "must start with http:// or https://"),
            ({"url": svc.url}, "is this router's own address"),
            ({"url": svc.url.replace("127.0.0.1", "localhost") + "/v1"}, "own address"),
            ({"block_size": 100_000}, "block_size must be 1-4096 tokens"),
        ]:
            status, err = await post(client, "/v1/workers", {**good, **change})
            assert status == 400, (change, err)
            assert message in err["error"]["message"], (change, err)
        assert await saved_ids(svc) == ["w0"]
        assert svc.ingest.ingested_workers == ["w0"]
        assert [w.worker_id for w in svc.workers] == ["w0"]
        # A path and query are stripped from the URL that is saved.
        status, added = await post(client, "/v1/workers", {**good, "url": ws[0].url + "/v1?x=1"})
        assert (status, added["worker"]["url"]) == (201, ws[0].url)

    run(redis_url, namespace, scenario, n=1)


def test_a_subscription_that_fails_saves_nothing(redis_url: str, namespace: str) -> None:
    """Validation passed but the event socket could not be set up: nothing is saved."""

    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        record = WorkerRecord(worker_id="w9", events_endpoint="tcp://127.0.0.1:1")
        msgspec.structs.force_setattr(record, "events_endpoint", "tcp://-no-such-host:1")
        with pytest.raises(
            SubscriberError, match="cannot subscribe to its events endpoint 'tcp://-no-such-host:1'"
        ):
            await svc.add_worker(record)
        assert await saved_ids(svc) == ["w0"]
        assert svc.ingest.ingested_workers == ["w0"]
        status, _ = await post(client, "/v1/route", {"prompt": "still routing", "dry_run": True})
        assert status == 200

    run(redis_url, namespace, scenario, n=1)


def test_a_registration_redis_refuses_leaves_no_subscription(private_redis: RedisServer) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        new = {"worker_id": "w9", "url": ws[0].url, "events": "tcp://127.0.0.1:1"}
        redis = svc.registry.client
        await redis.config_set("maxmemory-policy", "noeviction")
        await redis.config_set("maxmemory", 1)  # every write is refused (OOM)
        try:
            status, err = await post(client, "/v1/workers", new)
        finally:
            await redis.config_set("maxmemory", 0)
        assert (status, err["error"]["type"]) == (503, "unavailable")
        assert "nothing was saved" in err["error"]["message"]
        assert await saved_ids(svc) == ["w0"]
        assert svc.ingest.ingested_workers == ["w0"]
        assert [w.worker_id for w in svc.workers] == ["w0"]
        assert (await post(client, "/v1/workers", new))[0] == 201  # fine once Redis is

    run(private_redis.url, "refused", scenario, n=1)


def test_an_unusable_saved_registration_can_be_replaced_or_removed(
    redis_url: str, namespace: str
) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        registry = svc.registry
        bad = b'{"worker_id": "bad", "events_endpoint": "garbage"}'
        await registry.client.hset(registry.layout.registry, "bad", bad)
        fixed = {"worker_id": "bad", "url": ws[0].url, "events": "tcp://127.0.0.1:1"}
        status, err = await post(client, "/v1/workers", fixed)
        assert status == 409
        assert "an unusable registration is saved (events endpoint 'garbage'" in str(err)
        async with client.put("/v1/workers/bad", json=fixed) as resp:
            assert (resp.status, (await resp.json())["outcome"]) == (200, "replaced")
        await registry.client.hset(registry.layout.registry, "bad", bad)
        async with client.delete("/v1/workers/bad") as resp:
            assert (resp.status, await resp.json()) == (200, {"removed": "bad"})
        assert await saved_ids(svc) == ["w0"]

    run(redis_url, namespace, scenario, n=1)
