"""Block sizes: one worker registered with an absurd block size changes no one else's
routing; a worker whose events disagree with its registration has those events dropped
(counted) and is flagged in ``/v1/workers``, ``/metrics`` and ``kvroute index check``.

A real router service in process, real Redis, real publishers and HTTP workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import pytest

from router.cli.index import check_workers
from router.front.config import RouterConfig
from router.front.service import RouterService
from tests.support.ingest import (
    LifetimeWorker,
    fake_workers,
    keys,
    lookup_is,
    match,
    sample,
    stored,
    streams_up,
    tokens,
)
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

HUGE = 4096  # the largest a registration accepts: longer than every prompt here


async def route(client: aiohttp.ClientSession, prompt: list[int]) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "dry_run": True}
    async with client.post("/v1/route", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


def test_an_absurd_block_size_harms_no_one_and_mismatched_events_are_flagged(
    redis_url: str, namespace: str
) -> None:
    async def main() -> None:
        # a-huge sorts first: the old router keyed every request with its block size.
        workers = LifetimeWorker("a-huge"), LifetimeWorker("w1"), LifetimeWorker("w2")
        async with fake_workers(*workers) as (huge, w1, w2):
            records = (
                msgspec.structs.replace(huge.record(), block_size=HUGE),
                w1.record(),
                w2.record(),
            )
            config = RouterConfig(
                redis_url=redis_url, namespace=namespace, port=0, workers=records, lease_ttl_s=1.5
            )
            svc = await RouterService.open(config)
            try:
                async with aiohttp.ClientSession(base_url=svc.url) as client:
                    await streams_up(svc, huge, w1, w2)
                    w1.publish(stored(1, 0, 3))
                    index = svc.ingest.index
                    await eventually(lookup_is(index, 1, {"w1": match(3)}), what="w1's prefix")
                    answer = await route(client, tokens(1))
                    assert answer["worker_id"] == "w1"
                    assert answer["matched_tokens"] == 12
                    matched = {c["worker_id"]: c["matched_tokens"] for c in answer["candidates"]}
                    assert matched == {"a-huge": 0, "w1": 12, "w2": 0}

                    # a-huge's events carry its real block size (4), not the registered one.
                    huge.publish(stored(2, 0, 2))

                    async def dropped() -> bool:
                        labels = {"worker": "a-huge", "reason": "block_size_mismatch"}
                        return sample(svc, "kvroute_ingest_skipped_total", **labels) == 1

                    await eventually(dropped, what="the mismatched BlockStored counted")
                    assert dict(await index.lookup(keys(2))) == {}
                    assert sample(svc, "kvroute_ingest_block_size_mismatch", worker="a-huge") == 1
                    assert sample(svc, "kvroute_ingest_block_size_mismatch", worker="w1") == 0
                    async with client.get("/metrics") as resp:
                        assert 'kvroute_ingest_block_size_mismatch{worker="a-huge"} 1.0' in (
                            await resp.text()
                        )

                    def listed(huge_flag: tuple[bool, int | None]) -> Callable[[], Awaitable[bool]]:
                        async def check() -> bool:
                            async with client.get("/v1/workers") as resp:
                                views = (await resp.json())["workers"]
                            flags = {
                                v["worker_id"]: (v["block_size_mismatch"], v["events_block_size"])
                                for v in views
                            }
                            return flags == {
                                "a-huge": huge_flag,
                                "w1": (False, None),
                                "w2": (False, None),
                            }

                        return check

                    await eventually(listed((True, 4)), what="a-huge flagged in /v1/workers")
                    async with aiohttp.ClientSession() as session:
                        targets = [(w.worker_id, w.http_url or "") for w in (huge, w1)]
                        checks = await check_workers(
                            index.store, index.keyer, session, targets, svc.registry
                        )
                    assert [(c.worker_id, c.block_size_mismatch) for c in checks] == [
                        ("a-huge", True),
                        ("w1", False),
                    ]
                    assert (checks[0].registered_block_size, checks[0].events_block_size) == (
                        HUGE,
                        4,
                    )
                    # The others route on as before.
                    answer = await route(client, tokens(1))
                    assert (answer["worker_id"], answer["matched_tokens"]) == ("w1", 12)
                    # Replaced by its real block size: the flag goes.
                    fixed = {"worker_id": "a-huge", "url": huge.http_url,
                             "events": huge.publisher.address,
                             "replay": huge.publisher.replay_address, "block_size": 4}  # fmt: skip
                    async with client.put("/v1/workers/a-huge", json=fixed) as resp:
                        assert resp.status == 200, await resp.text()
                    await eventually(listed((False, None)), what="a-huge's flag dropped")
            finally:
                await svc.close()

    asyncio.run(main())
