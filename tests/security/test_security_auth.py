"""Attacks on the router's HTTP API: keys, JSON-only bodies, CURVE, allowed nets, headers.

The attack: a stranger who reaches the router registers a rogue worker (whose
``BlockStored`` events then draw a victim's prompts to it, ``Authorization`` headers
included), removes workers, or makes a victim's browser post to it cross-site. Each test
runs a real router (in process, real Redis, real aiohttp) in front of real HTTP workers
that record what they receive.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from events.auth import BearerKey
from events.curve import CurveKeyPair
from router.front.access import exposure_warning
from router.front.app import guards
from router.front.config import RouterConfig
from router.front.proxy_contracts import ProxyConfig
from router.front.service import RouterService
from tests.support.router_app import JSON, EchoWorker, post, run, saved_ids

ADMIN = "admin-7f3a9c"
API = "api-51be02"
ADMIN_KEY = BearerKey(ADMIN, "test")
API_KEY = BearerKey(API, "test")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def rogue(ws: list[EchoWorker]) -> dict[str, Any]:
    return {"worker_id": "rogue", "url": ws[0].url, "events": "tcp://127.0.0.1:9"}


def test_without_the_admin_key_workers_cannot_be_added_removed_or_listed(
    redis_url: str, namespace: str
) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        for headers, challenge in [
            ({}, 'Bearer realm="kvroute"'),
            (bearer("wrong"), 'Bearer realm="kvroute", error="invalid_token"'),
            (bearer(API), 'Bearer realm="kvroute", error="invalid_token"'),
            ({"Authorization": ADMIN}, 'Bearer realm="kvroute", error="invalid_request"'),
        ]:
            async with client.post("/v1/workers", json=rogue(ws), headers=headers) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"] == challenge
                error = (await resp.json())["error"]
            assert error["type"] == "authentication_error"
            assert error["message"] == (
                "POST /v1/workers needs the router's admin key: send 'Authorization: Bearer "
                "KEY' with the key of --admin-key"
            )
            async with client.put("/v1/workers/w0", json=rogue(ws), headers=headers) as resp:
                assert resp.status == 401
            async with client.delete("/v1/workers/w0", headers=headers) as resp:
                assert resp.status == 401
            async with client.get("/v1/workers", headers=headers) as resp:
                assert resp.status == 401
        # Nothing changed: the registry in Redis and the router's workers.
        assert await saved_ids(svc) == ["w0"]
        assert [w.worker_id for w in svc.workers] == ["w0"]
        assert svc.ingest.ingested_workers == ["w0"]
        # The open endpoints stay open; inference has no key of its own here.
        for path in ("/health", "/metrics"):
            async with client.get(path) as resp:
                assert resp.status == 200
        assert (await post(client, "/v1/route", {"prompt": "open", "dry_run": True}))[0] == 200
        # With the key, the same requests work.
        status, _ = await post(client, "/v1/workers", rogue(ws), bearer(ADMIN))
        assert status == 201
        async with client.get("/v1/workers", headers=bearer(ADMIN)) as resp:
            assert [w["worker_id"] for w in (await resp.json())["workers"]] == ["rogue", "w0"]
        async with client.delete("/v1/workers/rogue", headers=bearer(ADMIN)) as resp:
            assert resp.status == 200
        assert await saved_ids(svc) == ["w0"]
        metrics = await (await client.get("/metrics")).text()
        assert 'kvroute_router_http_requests_total{endpoint="/v1/workers",status="401"} 8.0' in (
            metrics
        )

    run(redis_url, namespace, scenario, n=1, admin_key=ADMIN_KEY)


@pytest.mark.slow
def test_the_api_key_guards_inference_and_opens_nothing_else(
    redis_url: str, namespace: str
) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        requests = [
            ("/v1/completions", {"prompt": "hello"}),
            ("/v1/chat/completions", chat),
            ("/v1/route", {"prompt": "hello", "dry_run": True}),
        ]
        for path, body in requests:
            for headers in ({}, bearer("wrong")):
                status, err = await post(client, path, body, headers)
                assert (status, err["error"]["type"]) == (401, "authentication_error")
                assert "needs the router's inference key" in err["error"]["message"]
                assert "--api-key" in err["error"]["message"]
            for key in (API, ADMIN):  # the admin key opens inference too
                assert (await post(client, path, body, bearer(key)))[0] == 200
        assert len(ws[0].bodies) == 4  # two completions, two chats; nothing unauthenticated
        status, _ = await post(client, "/v1/workers", rogue(ws), bearer(API))
        assert status == 401  # the API key is not the admin key
        assert await saved_ids(svc) == ["w0"]

    run(redis_url, namespace, scenario, n=1, admin_key=ADMIN_KEY, api_key=API_KEY)


def test_bodies_must_be_sent_as_json(redis_url: str, namespace: str) -> None:
    """A cross-site form or text/plain POST (no CORS preflight) is refused: 415."""

    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        body = b'{"worker_id": "rogue", "url": "%s", "events": "tcp://127.0.0.1:9"}' % (
            ws[0].url.encode()
        )
        for content_type in ("text/plain", "application/x-www-form-urlencoded",
                             "multipart/form-data; boundary=x", None):  # fmt: skip
            headers = {} if content_type is None else {"Content-Type": content_type}
            for path, payload in (("/v1/workers", body), ("/v1/completions", b'{"prompt": "x"}')):
                async with client.post(path, data=payload, headers=headers) as resp:
                    assert resp.status == 415, (path, content_type)
                    error = (await resp.json())["error"]
                assert error["type"] == "invalid_request_error"
                assert error["message"].startswith("Content-Type must be application/json, got")
        text = {"Content-Type": "text/plain"}
        async with client.put("/v1/workers/rogue", data=body, headers=text) as resp:
            assert resp.status == 415
        assert await saved_ids(svc) == ["w0"]
        assert ws[0].prompts == []
        utf8 = {"Content-Type": "application/json; charset=utf-8"}
        async with client.post("/v1/workers", data=body, headers=utf8) as resp:
            assert resp.status == 201

    run(redis_url, namespace, scenario, n=1)


def test_require_curve_refuses_a_worker_without_its_server_key(
    redis_url: str, namespace: str
) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        plain = {"worker_id": "w9", "url": "http://127.0.0.1:9", "events": "tcp://127.0.0.1:9"}
        status, err = await post(client, "/v1/workers", plain)
        assert status == 400
        assert "has no server_key, and this router requires CURVE-authenticated" in str(err)
        assert await saved_ids(svc) == []
        secured = {**plain, "server_key": CurveKeyPair.generate().public_key.decode()}
        assert (await post(client, "/v1/workers", secured))[0] == 201

    run(redis_url, namespace, scenario, n=0, require_curve=True)


def test_worker_addresses_outside_the_allowed_nets_are_refused(
    redis_url: str, namespace: str
) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        inside = {"worker_id": "w9", "url": ws[0].url, "events": "tcp://127.0.0.1:9"}
        for change, refused in [
            ({"url": "http://10.0.0.9:8000"}, "url host '10.0.0.9'"),
            ({"url": "http://evil.example:8000"}, "url host 'evil.example'"),
            ({"events": "tcp://192.0.2.1:5557"}, "events host '192.0.2.1'"),
            ({"replay": "tcp://[2001:db8::1]:5558"}, "replay host '2001:db8::1'"),
        ]:
            status, err = await post(client, "/v1/workers", {**inside, **change})
            assert status == 400
            assert f"{refused} is outside the networks this router may reach" in str(err)
        assert await saved_ids(svc) == ["w0"]
        assert (await post(client, "/v1/workers", inside))[0] == 201
        named = {**inside, "worker_id": "n", "url": "http://gpu-1.internal:8000"}
        assert (await post(client, "/v1/workers", named))[0] == 201  # listed by name

    run(redis_url, namespace, scenario, n=1, allow_worker_nets=("127.0.0.0/8", "gpu-1.internal"))


@pytest.mark.parametrize("forward", [False, True])
def test_the_clients_authorization_reaches_a_worker_only_when_configured(
    redis_url: str, namespace: str, forward: bool
) -> None:
    async def scenario(
        svc: RouterService, client: aiohttp.ClientSession, ws: list[EchoWorker]
    ) -> None:
        headers = {**JSON, "Authorization": "Bearer client-secret", "X-Request-Id": "r1"}
        chat = {"messages": [{"role": "user", "content": "x"}]}
        for path, body in (
            ("/v1/completions", {"prompt": "hello"}),
            ("/v1/chat/completions", chat),
        ):
            async with client.post(path, json=body, headers=headers) as resp:
                assert resp.status == 200
        assert len(ws[0].headers) == 2
        for seen in ws[0].headers:
            assert seen["x-request-id"] == "r1"
            assert seen.get("authorization") == ("Bearer client-secret" if forward else None)

    run(redis_url, namespace, scenario, n=1, proxy=ProxyConfig(forward_authorization=forward))


def test_a_router_beyond_loopback_says_exactly_what_is_open() -> None:
    def warning(host: str, **keys: BearerKey) -> str | None:
        return exposure_warning(host, *guards(RouterConfig(redis_url="redis://x", **keys)))

    for loopback in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert warning(loopback) is None
    assert warning("0.0.0.0", admin_key=ADMIN_KEY, api_key=API_KEY) is None
    assert warning("0.0.0.0") == (
        "listening on 0.0.0.0, reachable from other machines, and anyone who reaches it can: "
        "register, replace, remove and list workers (GET/POST /v1/workers, PUT/DELETE "
        "/v1/workers/{id}; a worker registered by a stranger receives the prompts routed to "
        "it) [--admin-key]; send requests to the workers (POST /v1/completions, "
        "/v1/chat/completions, /v1/route, GET /v1/models) [--api-key]. Set the keys in "
        "brackets (or their "
        "-file / $KVROUTE_* forms) to require a bearer token"
    )
    only_inference = warning("10.0.0.1", admin_key=ADMIN_KEY)
    assert only_inference is not None
    assert "send requests to the workers" in only_inference
    assert "register" not in only_inference
    only_admin = warning("10.0.0.1", api_key=API_KEY)
    assert only_admin is not None and "[--admin-key]" in only_admin
    assert "[--api-key]" not in only_admin


def test_keys_never_show_in_a_config_repr() -> None:
    config = RouterConfig(redis_url="redis://x", admin_key=ADMIN_KEY, api_key=API_KEY)
    assert ADMIN not in repr(config) and API not in repr(config)
