"""Replay: an event log rebuilt into an index at chosen moments, in memory and in Redis."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.recorder import LogRecord
from router.cli.replay import main as replay_main
from router.index.memory import MemoryPrefixIndex
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.offline.replay import REPLAY_LEASE_TTL_MS, ReplayError, redis_lease_taker, replay_log
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRegistry
from tests.support.replay_log import BS, SCENARIO, TOKENS, batch, removed, stored, write_log

KEYS = RouterKeyer().keys(TOKENS, BS)


async def matched(index: MemoryPrefixIndex | RedisPrefixIndex) -> dict[str, int]:
    found = await index.lookup(KEYS)
    return {w: m.num_blocks for w, m in sorted(found.items())}


@pytest.mark.parametrize(
    ("at", "expected"),
    [
        (99.0, {}),
        (100.0, {"w0": 3}),
        (101.0, {"w0": 4, "w1": 2}),
        (102.0, {"w0": 5, "w1": 2}),  # block 3 evicted, then stored again with block 4
        (103.0, {"w0": 5}),  # w1's publisher restarted: its entries are gone
        (103.5, {"w0": 5, "w1": 1}),
        (104.0, {"w1": 1}),  # w0 resynced without a snapshot: nothing claimed
        (105.0, {"w1": 1}),  # orphans are detached, never claimed
        (106.0, {"w0": 1, "w1": 1}),
    ],
)
def test_memory_replay_at_each_moment(tmp_path: Path, at: float, expected: dict[str, int]) -> None:
    log = write_log(tmp_path / "events.kvlog", SCENARIO)
    index = BridgedIndex(MemoryPrefixIndex())
    asyncio.run(replay_log(log, at, index))
    assert asyncio.run(matched(index)) == expected


def test_summary_counts_what_was_fed(tmp_path: Path) -> None:
    log = write_log(tmp_path / "events.kvlog", SCENARIO)
    summary = asyncio.run(replay_log(log, 106.0, BridgedIndex(MemoryPrefixIndex())))
    w0, w1 = summary.workers["w0"], summary.workers["w1"]
    assert (w0.num_batches, w0.num_events, w0.num_resyncs, w0.num_resets) == (5, 6, 1, 0)
    assert (w0.last_seq, w0.last_ts, w0.block_size) == (8, 106.0, BS)
    assert (w1.num_batches, w1.num_resets, w1.last_seq) == (2, 1, 0)
    assert summary.num_records == 9


def test_orphan_parent_resyncs_the_worker_like_the_router(tmp_path: Path) -> None:
    # w0's log starts mid-stream: block 2's parent was never seen.
    records = [batch(1.0, "w0", 4, stored(2, 3)), batch(2.0, "w0", 5, stored(3, 4))]
    log = write_log(tmp_path / "late.kvlog", records)
    index = BridgedIndex(MemoryPrefixIndex())
    summary = asyncio.run(replay_log(log, 2.0, index))
    assert summary.workers["w0"].num_orphans == 1
    assert asyncio.run(index.worker_entries(WorkerId("w0"))) == {}
    assert index.bridge(WorkerId("w0")).tolerate_orphans


def test_undecodable_payload_is_counted_and_skipped(tmp_path: Path) -> None:
    records = [LogRecord(1.0, "w0", "batch", 0, b"\xc1"), batch(2.0, "w0", 1, stored(0, 1))]
    log = write_log(tmp_path / "bad.kvlog", records)
    index = BridgedIndex(MemoryPrefixIndex())
    summary = asyncio.run(replay_log(log, 2.0, index))
    assert summary.workers["w0"].num_undecodable == 1
    assert asyncio.run(matched(index)) == {"w0": 1}


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["w0", "w1"]), st.sampled_from(["store", "remove", "reset"])
        ).flatmap(lambda t: st.tuples(st.just(t[0]), st.just(t[1]), st.integers(1, 6))),
        max_size=25,
    )
)
def test_replay_matches_a_reference_model(ops: list[tuple[str, str, int]]) -> None:
    """Prefix chains stored, evicted from the tail, and publisher resets, per worker."""
    records: list[LogRecord] = []
    depth = {"w0": 0, "w1": 0}  # each worker holds blocks 0..depth-1
    seq = {"w0": 0, "w1": 0}
    for i, (worker, op, n) in enumerate(ops):
        ts = float(i)
        if op == "reset":
            records.append(LogRecord(ts, worker, "reset", 0))
            depth[worker] = seq[worker] = 0
            continue
        if op == "store" and n > depth[worker]:
            records.append(batch(ts, worker, seq[worker], stored(depth[worker], n)))
        elif op == "remove" and n <= depth[worker]:
            tail = range(depth[worker] - 1, n - 2, -1)  # evict from the leaf up
            records.append(batch(ts, worker, seq[worker], removed(*tail)))
            n -= 1
        else:
            continue
        depth[worker] = n
        seq[worker] += 1

    index = BridgedIndex(MemoryPrefixIndex())
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(replay_log(write_log(Path(tmp) / "p.kvlog", records), len(ops), index))
    assert asyncio.run(matched(index)) == {w: d for w, d in sorted(depth.items()) if d}


@pytest.mark.slow
def test_redis_replay_equals_memory_and_refuses_a_live_namespace(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    log = write_log(tmp_path / "events.kvlog", SCENARIO)

    async def run() -> None:
        client = await connect(redis_url)
        try:
            layout = KeyLayout(namespace)
            index = BridgedIndex(RedisPrefixIndex(client, layout))
            registry = WorkerRegistry(client, layout, lease_ttl_ms=REPLAY_LEASE_TTL_MS)
            await replay_log(log, 103.5, index, redis_lease_taker(index, registry))
            assert await matched(index) == {"w0": 5, "w1": 1}
            again = BridgedIndex(RedisPrefixIndex(client, layout))
            other = WorkerRegistry(client, layout, lease_ttl_ms=REPLAY_LEASE_TTL_MS)
            with pytest.raises(ReplayError, match="namespace of its own"):
                await replay_log(log, 103.5, again, redis_lease_taker(again, other))
        finally:
            # The replay leaves its namespace for inspection (leases of a week): remove it.
            stale = [key async for key in client.scan_iter(match=f"kvroute:{namespace}:*")]
            if stale:
                await client.delete(*stale)
            await client.aclose()

    asyncio.run(run())


def test_cli_prints_a_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "events.kvlog", SCENARIO)
    assert replay_main([str(log), "--at", "+2", "--memory"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("replayed to 1970-01-01T00:01:42.000+00:00 (+2.000 s")
    assert out[0].endswith("4 of 9 records")
    assert out[1].split() == [
        "worker", "batches", "events", "resets", "resyncs", "orphans", "last", "seq", "entries",
    ]  # fmt: skip
    assert out[2].split() == ["w0", "3", "4", "0", "0", "0", "2", "5"]
    assert out[3].split() == ["w1", "1", "1", "0", "0", "0", "0", "2"]
    assert out[4] == "index: 7 entries, 5 keys, 2 workers"
    assert replay_main([str(log), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workers"]["w0"]["entries"] == 1
    assert data["workers"]["w0"]["orphans"] == 0
    assert data["records_applied"] == 9


def test_cli_errors_are_clear(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = write_log(tmp_path / "events.kvlog", SCENARIO)
    assert replay_main([str(log), "--at", "soon"]) == 1
    assert "--at 'soon' is not 'end'" in caplog.text
    assert replay_main([str(tmp_path / "missing.kvlog")]) == 1
    assert "missing.kvlog" in caplog.text
    not_a_log = tmp_path / "x.txt"
    not_a_log.write_text("hello")
    assert replay_main([str(not_a_log)]) == 1
    assert "is not a kvroute event log" in caplog.text
