"""``kvroute index check`` and ``kvroute index stats`` against a live ingest."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.cli import main as kvroute_main
from tests.router.test_ingest_helpers import (
    FakeWorker,
    eventually,
    fake_workers,
    lookup_is,
    match,
    stack,
    stored,
)


def test_check_and_stats(
    redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--redis", redis_url, "--namespace", namespace]

    async def cli(*argv: str) -> int:
        # The CLI runs its own event loop; this loop keeps serving the worker's snapshot.
        return await asyncio.to_thread(kvroute_main, ["index", *argv])

    async def main() -> None:
        async with fake_workers(FakeWorker("k1")) as (k1,):
            k1.publish(stored(1, 0, 3), stored(2, 0, 2))
            async with stack(redis_url, namespace, [k1.record()]) as s:
                await eventually(lookup_is(s.index, 1, {"k1": match(3)}), what="ingested")
                spec = f"k1={k1.http_url}"
                assert await cli("check", *common, "--worker", spec) == 0
                assert "0 divergent entries" in capsys.readouterr().out
                # Without --worker: every registered kvroute worker.
                assert await cli("check", *common, "--json") == 0
                report = json.loads(capsys.readouterr().out)
                assert report == [
                    {
                        "worker_id": "k1",
                        "num_expected": 5,
                        "num_indexed": 5,
                        "num_missing": 0,
                        "num_extra": 0,
                        "num_tier_mismatch": 0,
                        "num_divergent": 0,
                    }
                ]
                assert await cli("stats", *common, "--json") == 0
                stats = json.loads(capsys.readouterr().out)
                assert (stats["num_entries"], stats["num_keys"], stats["num_workers"]) == (5, 5, 1)
                assert stats["memory_bytes"] > 0
            # The router is gone: what the worker caches now is missing from the index.
            k1.publish(stored(1, 3, 2))
            assert await cli("check", *common, "--worker", spec, "--json") == 1
            (row,) = json.loads(capsys.readouterr().out)
            assert (row["num_missing"], row["num_extra"], row["num_divergent"]) == (2, 0, 2)
            assert await cli("check", *common, "--worker", "nonsense") == 2
            assert "expected ID=HTTP_URL" in capsys.readouterr().err

    asyncio.run(main())
