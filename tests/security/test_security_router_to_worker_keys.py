"""A router that talks to keyed workers: it sends the workers' API key with every forwarded
request (never the client's own credentials) and their admin key to read snapshots, so a
cluster whose workers require keys routes, resyncs and checks its index. A real worker with
both keys, a real router service in process, a real Redis."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from events.auth import BearerKey, SentKey
from events.identity import WorkerId
from pool.worker.guards import AccessKeys
from router.cli.index import main as index_main
from router.front.config import RouterConfig
from router.front.proxy_contracts import ProxyConfig
from router.front.service import RouterService
from router.workers.registry import WorkerRecord
from tests.support.ingest import sample
from tests.support.polling import eventually
from tests.support.workers import BLOCK_SIZE, RunningWorker, start_worker, worker_config

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

ADMIN = "worker-admin-0123456789"
API = "worker-api-9876543210"
CLIENT = "client-own-credentials-42"


@pytest.fixture(scope="module")
def keyed() -> Iterator[RunningWorker]:
    keys = AccessKeys(admin=BearerKey(ADMIN, "test"), api=BearerKey(API, "test"))
    running = start_worker(worker_config(64, worker_id="kw", keys=keys))
    yield running
    running.stop()


def record(worker: RunningWorker) -> WorkerRecord:
    return WorkerRecord(
        worker_id=WorkerId("kw"),
        http_url=worker.http,
        events_endpoint=worker.events,
        replay_endpoint=worker.replay,
        topic="kv",
        block_size=BLOCK_SIZE,
    )


async def complete(svc: RouterService) -> int:
    async with aiohttp.ClientSession() as client:
        body = {"prompt": "keys between hosts", "max_tokens": 2}
        headers = {"Authorization": f"Bearer {CLIENT}"}
        async with client.post(f"{svc.url}/v1/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status


def test_a_router_with_the_workers_keys_routes_and_loads_snapshots(
    keyed: RunningWorker, redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async def main() -> None:
        config = RouterConfig(
            redis_url=redis_url,
            namespace=namespace,
            port=0,
            workers=(record(keyed),),
            proxy=ProxyConfig(worker_key=SentKey(API, "test"), forward_authorization=True),
            worker_admin_key=SentKey(ADMIN, "test"),
        )
        async with await RouterService.open(config) as svc:
            labels = {"worker": "kw", "outcome": "ok"}

            async def loaded() -> bool:
                return sample(svc, "kvroute_ingest_snapshots_total", **labels) >= 1

            await eventually(loaded, what="the worker's snapshot loaded with the admin key")
            assert await complete(svc) == 200  # the client's own key went nowhere
            assert sample(svc, "kvroute_ingest_snapshots_total", worker="kw", outcome="failed") == 0

    asyncio.run(main())
    argv = ["check", "--redis", redis_url, "--namespace", namespace, "--json",
            "--worker", f"kw={keyed.http}"]  # fmt: skip
    assert index_main([*argv, "--worker-admin-key", ADMIN]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["worker_id"], r["num_divergent"]) for r in rows] == [("kw", 0)]


def test_without_the_keys_the_worker_refuses_the_router(
    keyed: RunningWorker, redis_url: str, namespace: str
) -> None:
    async def main() -> None:
        config = RouterConfig(
            redis_url=redis_url, namespace=namespace, port=0, workers=(record(keyed),)
        )
        async with await RouterService.open(config) as svc:
            labels = {"worker": "kw", "outcome": "failed"}

            async def refused() -> bool:
                return sample(svc, "kvroute_ingest_snapshots_total", **labels) >= 1

            await eventually(refused, what="the snapshot read refused without the admin key")
            assert await complete(svc) != 200

    asyncio.run(main())
