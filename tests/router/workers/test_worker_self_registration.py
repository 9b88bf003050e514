"""A kvroute worker registering itself with a real router (``--register-url``).

The worker announces its advertised addresses (``--advertise-host``), never a wildcard; the
router subscribes and routes to what was registered, and takes the registration back when
the worker drains. A router that is not up yet is asked again; a refusal stops the worker
with the router's own reason. Everything runs on loopback in this process: the worker binds
127.0.0.1 and advertises ``localhost``, a name only the advertisement can have put there.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from events.auth import BearerKey, SentKey
from events.curve import CurveKeyPair, load_public_key, write_keypair
from pool.worker.cli import serve
from pool.worker.config import WorkerConfig
from pool.worker.router_registration import RegistrationRefusedError
from router.front.config import RouterConfig
from router.front.service import RouterService
from router.store.server import free_port
from tests.support.polling import eventually
from tests.support.workers import worker_config

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0


def registering(register_url: str, **overrides: Any) -> WorkerConfig:
    """A loopback worker that registers with ``register_url`` as ``localhost``."""
    config = worker_config(32, register_url=register_url, advertise_host="localhost")
    return dataclasses.replace(config, **overrides)


@asynccontextmanager
async def router(
    redis_url: str, namespace: str, **overrides: Any
) -> AsyncIterator[tuple[RouterService, aiohttp.ClientSession]]:
    config = RouterConfig(redis_url=redis_url, namespace=namespace, port=0)
    async with (
        await RouterService.open(dataclasses.replace(config, **overrides)) as service,
        aiohttp.ClientSession(base_url=service.url) as client,
    ):
        yield service, client


async def registered(client: aiohttp.ClientSession, key: str | None = None) -> list[Any]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with client.get("/v1/workers", headers=headers) as resp:
        assert resp.status == 200
        return list((await resp.json())["workers"])


def test_a_worker_registers_its_advertised_addresses_and_leaves_when_it_drains(
    redis_url: str, namespace: str
) -> None:
    async def scenario() -> None:
        async with router(redis_url, namespace) as (svc, client):
            stop = asyncio.Event()
            ready: list[dict[str, Any]] = []
            worker = asyncio.ensure_future(serve(registering(svc.url), stop, ready.append))
            await eventually(lambda: bool(ready) or worker.done(), "the worker's ready line")
            http, events, replay = ready[0]["http"], ready[0]["events"], ready[0]["replay"]
            assert http.startswith("http://localhost:")
            assert events.startswith("tcp://localhost:")
            assert replay.startswith("tcp://localhost:")

            async def listed() -> bool:
                return bool(await registered(client))

            await eventually(listed, "the worker's registration", timeout_s=TIMEOUT_S)
            (view,) = await registered(client)
            assert {k: view[k] for k in ("worker_id", "url", "events", "replay")} == {
                "worker_id": "w-test",
                "url": http,
                "events": events,
                "replay": replay,
            }
            assert (view["topic"], view["block_size"], view["models"]) == (
                "kv",
                4,
                ["kvroute-tiny"],
            )
            body = {"prompt": "hello there", "max_tokens": 2}
            async with client.post("/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["X-Kvroute-Worker"] == "w-test"
            stop.set()
            await asyncio.wait_for(worker, TIMEOUT_S)
            assert await registered(client) == []

    asyncio.run(scenario())


def test_a_worker_keeps_asking_until_its_router_is_up(redis_url: str, namespace: str) -> None:
    port = free_port()

    async def scenario() -> None:
        stop = asyncio.Event()
        worker = asyncio.ensure_future(serve(registering(f"http://127.0.0.1:{port}"), stop))
        try:
            async with router(redis_url, namespace, port=port) as (_, client):

                async def listed() -> bool:
                    assert not worker.done(), worker
                    return bool(await registered(client))

                await eventually(listed, "the worker's registration", timeout_s=TIMEOUT_S)
                stop.set()
                await asyncio.wait_for(worker, TIMEOUT_S)
                assert await registered(client) == []
        finally:
            stop.set()
            await asyncio.wait_for(worker, TIMEOUT_S)

    asyncio.run(scenario())


def test_a_refusing_router_stops_the_worker_with_its_reason(
    redis_url: str, namespace: str
) -> None:
    async def scenario() -> None:
        async with router(redis_url, namespace, admin_key=BearerKey("adm1n", "test")) as (
            svc,
            client,
        ):
            no_key = serve(registering(svc.url), asyncio.Event())
            with pytest.raises(RegistrationRefusedError) as info:
                await asyncio.wait_for(no_key, TIMEOUT_S)
            assert f"the router at {svc.url}/v1/workers/w-test refused this worker (401)" in (
                str(info.value)
            )
            stop = asyncio.Event()
            keyed = registering(svc.url, router_key=SentKey("adm1n", "test"))
            worker = asyncio.ensure_future(serve(keyed, stop))

            async def listed() -> bool:
                assert not worker.done(), worker
                return bool(await registered(client, "adm1n"))

            await eventually(listed, "the keyed worker's registration", timeout_s=TIMEOUT_S)
            stop.set()
            await asyncio.wait_for(worker, TIMEOUT_S)

        async with router(redis_url, namespace, allow_worker_nets=("10.0.0.0/8",)) as (svc, _):
            with pytest.raises(RegistrationRefusedError) as info:
                await asyncio.wait_for(serve(registering(svc.url), asyncio.Event()), TIMEOUT_S)
            assert "refused this worker (400): invalid worker: url host 'localhost' is " in (
                str(info.value)
            )

    asyncio.run(scenario())


def test_a_curve_worker_registers_its_public_key_with_a_router_that_requires_one(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    router_public, router_secret = write_keypair(tmp_path, "router")
    worker_public, worker_secret = write_keypair(tmp_path, "w-test")
    client_keys = CurveKeyPair.load(router_secret)

    async def scenario() -> None:
        async with router(
            redis_url, namespace, require_curve=True, client_keys=client_keys
        ) as (svc, client):
            stop = asyncio.Event()
            config = registering(
                svc.url, curve_secret_key=str(worker_secret), curve_allow=str(router_public)
            )
            worker = asyncio.ensure_future(serve(config, stop))

            async def listed() -> bool:
                assert not worker.done(), worker
                return bool(await registered(client))

            await eventually(listed, "the CURVE worker's registration", timeout_s=TIMEOUT_S)
            (view,) = await registered(client)
            assert view["server_key"] == load_public_key(worker_public).decode()
            body = {"prompt": "over an encrypted stream", "max_tokens": 2}
            async with client.post("/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            applied = 'kvroute_ingest_batches_total{outcome="applied",worker="w-test"}'

            async def ingested() -> bool:
                async with client.get("/metrics") as resp:
                    return applied in await resp.text()

            await eventually(ingested, "the worker's events, over CURVE", timeout_s=TIMEOUT_S)
            stop.set()
            await asyncio.wait_for(worker, TIMEOUT_S)

    asyncio.run(scenario())


def test_a_wildcard_bind_without_an_advertise_host_fails_before_anything_listens() -> None:
    config = registering("http://127.0.0.1:9", host="0.0.0.0", advertise_host=None)

    async def scenario() -> None:
        await serve(config, asyncio.Event())

    with pytest.raises(RegistrationRefusedError, match=r"cannot register http://0\.0\.0\.0:0"):
        asyncio.run(scenario())
