"""``kvroute index check`` and ``kvroute index stats`` against a live ingest."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from router.cli.main import main as kvroute_main
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRegistry
from tests.support.ingest import (
    FakeWorker,
    fake_workers,
    lookup_is,
    match,
    stack,
    stored,
)
from tests.support.polling import eventually


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
                        "registered_block_size": 4,
                        "events_block_size": None,
                        "num_divergent": 0,
                        "block_size_mismatch": False,
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


def test_register_list_unregister(
    redis_url: str, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--redis", redis_url, "--namespace", namespace]
    config = tmp_path / "workers.json"
    config.write_text(
        '[{"worker_id": "v1", "events_endpoint": "tcp://127.0.0.1:6001", "kind": "vllm"}]'
    )
    spec = "k1=tcp://127.0.0.1:5001,replay=tcp://127.0.0.1:5002,http=http://127.0.0.1:8001"
    argv = ["index", "register", *common, "--worker", spec, "--config", str(config)]
    assert kvroute_main(argv) == 0
    assert "registered 2 worker(s)" in capsys.readouterr().out
    assert kvroute_main(["index", "workers", *common, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["worker_id"], r["kind"], r["lease"], r["owner"]) for r in rows] == [
        ("k1", "kvroute", None, None),  # no router alive: nobody owns them
        ("v1", "vllm", None, None),
    ]
    assert rows[0]["replay_endpoint"] == "tcp://127.0.0.1:5002"
    assert kvroute_main(["index", "unregister", *common, "v1"]) == 0
    assert kvroute_main(["index", "unregister", *common, "v1"]) == 1
    assert "was not registered" in capsys.readouterr().err
    asyncio.run(_join(redis_url, namespace, "r9"))  # a live router: it owns every worker
    assert kvroute_main(["index", "workers", *common]) == 0
    listing = capsys.readouterr().out
    assert "k1" in listing and "v1" not in listing and "owner=r9" in listing
    assert kvroute_main(["index", "register", *common, "--worker", "bad"]) == 2
    assert kvroute_main(["index", "register", *common]) == 2
    assert "nothing to register" in capsys.readouterr().err
    assert kvroute_main(["index", "unregister", *common, "k1"]) == 0


async def _join(url: str, namespace: str, router: str) -> None:
    """Heartbeat once as router ``router`` (a live router for a lease TTL)."""
    client = await connect(url)
    try:
        await WorkerRegistry(client, KeyLayout(namespace), owner=router).heartbeat()
    finally:
        await client.aclose()


def test_register_validates_and_refuses_to_replace_silently(
    redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--redis", redis_url, "--namespace", namespace]

    def register(*specs: str, replace: bool = False) -> int:
        argv = ["index", "register", *common, *(a for s in specs for a in ("--worker", s))]
        return kvroute_main(argv + (["--replace"] if replace else []))

    def saved() -> list[tuple[str, str]]:
        capsys.readouterr()
        assert kvroute_main(["index", "workers", *common, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        return [(r["worker_id"], r["events_endpoint"]) for r in rows]

    # Invalid specs are refused before anything is saved (here the second of two).
    assert register("k1=tcp://127.0.0.1:5001", "k2=garbage") == 2
    assert "events endpoint 'garbage'" in capsys.readouterr().err
    assert register("k1=tcp://127.0.0.1:5001,http=http://h:99999") == 2
    assert "Port out of range" in capsys.readouterr().err
    assert saved() == []
    assert register("k1=tcp://127.0.0.1:5001") == 0
    assert register("k1=tcp://127.0.0.1:5001") == 0  # the same again: unchanged
    capsys.readouterr()
    # The same id on another endpoint is refused unless --replace says so.
    assert register("k1=tcp://127.0.0.1:5009") == 1
    err = capsys.readouterr().err
    assert "events_endpoint 'tcp://127.0.0.1:5001' (saved) vs 'tcp://127.0.0.1:5009'" in err
    assert "pass --replace to replace it" in err
    assert saved() == [("k1", "tcp://127.0.0.1:5001")]
    assert register("k1=tcp://127.0.0.1:5009", replace=True) == 0
    assert saved() == [("k1", "tcp://127.0.0.1:5009")]
    assert kvroute_main(["index", "unregister", *common, "k1"]) == 0
