"""Event log writer and reader, the recording sink, and the record/dump/tail commands."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.cli.events import main as events_main
from events.cli.record import main as record_main
from events.recorder import (
    LOG_MAGIC,
    EventLogError,
    EventLogWriter,
    EventRecorder,
    LogRecord,
    last_batch_seqs,
    read_log,
)
from events.schema import encode_batch
from events.subscriber import EventSubscriber, ReceivedBatch, WorkerStream
from tests.support.event_streams import (
    DEADLINE_S,
    RecordingSink,
    batch,
    handshake,
    loopback_publisher,
)
from tests.support.paths import REPO_ROOT as REPO

records_strategy = st.lists(
    st.builds(
        LogRecord,
        recv_ts=st.floats(allow_nan=False, allow_infinity=False),
        worker_id=st.text(max_size=8),
        kind=st.sampled_from(["batch", "reset", "resync"]),
        seq=st.none() | st.integers(0, 2**63),
        payload=st.binary(max_size=64),
        replayed=st.booleans(),
        reason=st.text(max_size=8),
    ),
    max_size=8,
)


def write(path: Path, records: list[LogRecord]) -> None:
    with EventLogWriter(path) as writer:
        for record in records:
            writer.write(record)


def sample_records() -> list[LogRecord]:
    return [
        LogRecord(1.5, "w0", "batch", 7, encode_batch(batch(7)), replayed=True),
        LogRecord(2.5, "w0", "reset", 0),
        LogRecord(3.5, "w1", "resync", None, reason="replay_timeout"),
    ]


def test_round_trip_and_append(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    records = sample_records()
    write(path, records[:2])
    write(path, records[2:])
    assert list(read_log(path)) == records
    assert path.read_bytes().startswith(LOG_MAGIC)


def test_last_batch_seqs_reads_how_far_each_worker_is_logged(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    assert last_batch_seqs(path) == {}  # not created yet
    write(path, [])
    assert last_batch_seqs(path) == {}  # the magic alone
    write(path, sample_records())
    write(path, [LogRecord(4.5, "w0", "batch", 9, encode_batch(batch(9)))])
    # Resets and resyncs carry no batch; w1 has only a resync.
    assert last_batch_seqs(path) == {"w0": 9}


@pytest.mark.slow
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(records=records_strategy, data=st.data())
def test_a_torn_tail_is_skipped_and_cut_off_on_append(
    tmp_path: Path, records: list[LogRecord], data: st.DataObject
) -> None:
    path = tmp_path / f"torn-{time.monotonic_ns()}.log"
    ends = [len(LOG_MAGIC)]
    with EventLogWriter(path) as writer:
        for record in records:
            writer.write(record)
            writer.flush()
            ends.append(path.stat().st_size)
    cut = data.draw(st.integers(len(LOG_MAGIC), ends[-1]), label="cut")
    os.truncate(path, cut)
    intact = sum(1 for end in ends[1:] if end <= cut)
    assert list(read_log(path)) == records[:intact]
    extra = LogRecord(9.0, "w9", "reset", 1)
    write(path, [extra])
    assert list(read_log(path)) == [*records[:intact], extra]


def test_zero_filled_tail_is_torn_but_a_bad_middle_record_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    records = sample_records()
    write(path, records[:2])
    last_at = path.stat().st_size
    write(path, records[2:])
    data = path.read_bytes()
    # A crash can leave the last record's length written but its body zero-filled.
    path.write_bytes(data[: last_at + 8] + bytes(len(data) - last_at - 8))
    assert list(read_log(path)) == records[:2]
    corrupt = bytearray(data)
    corrupt[len(LOG_MAGIC) + 8] ^= 0xFF  # inside the first record's body
    path.write_bytes(corrupt)
    with pytest.raises(EventLogError, match="corrupt record at byte 8"):
        list(read_log(path))
    path.write_bytes(b"not a log")
    with pytest.raises(EventLogError, match="not a kvroute event log"):
        list(read_log(path))
    with pytest.raises(EventLogError, match="not a kvroute event log"):
        EventLogWriter(path)


def test_recorder_sink_logs_deliveries_in_order_with_replays(tmp_path: Path) -> None:
    path = tmp_path / "events.log"

    class Tee(RecordingSink):
        def __init__(self, recorder: EventRecorder) -> None:
            super().__init__()
            self.recorder = recorder

        async def on_batch(self, received: ReceivedBatch) -> None:
            await self.recorder.on_batch(received)
            await super().on_batch(received)

    async def scenario() -> None:
        skipped: set[int] = set()
        with EventLogWriter(path) as writer, loopback_publisher(skip_live_seqs=skipped) as pub:
            sink = Tee(EventRecorder(writer))
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(WorkerStream("w0", pub.address, pub.replay_address))
                await handshake(sink, "w0", lambda: pub.publish(batch(0)))
                skipped.update({pub.next_seq + 1, pub.next_seq + 2})
                for i in range(5):
                    pub.publish(batch(i))
                await sink.wait_for(lambda: sub.last_seq("w0") == pub.next_seq - 1)
                await sink.recorder.on_reset("w0", 0)
                await sink.recorder.on_resync_needed("w0", "replay_timeout")
        logged = list(read_log(path))
        assert [(r.kind, r.seq) for r in logged[:-2]] == [("batch", b.seq) for b in sink.batches]
        assert [r.payload for r in logged[:-2]] == [b.payload for b in sink.batches]
        assert [r.replayed for r in logged[:-2]] == [b.replayed for b in sink.batches]
        assert [(r.kind, r.seq, r.reason) for r in logged[-2:]] == [
            ("reset", 0, ""),
            ("resync", None, "replay_timeout"),
        ]
        assert logged[0].decode() == sink.batches[0].batch

    asyncio.run(scenario())


def test_dump_prints_one_event_per_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "events.log"
    write(path, [*sample_records(), LogRecord(4.5, "w2", "batch", 3, b"\xc1")])
    assert events_main(["dump", str(path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    common = {"block_hashes": None, "parent_block_hash": None, "token_ids": None}
    common |= {"block_size": None, "medium": None}
    assert rows == [
        {
            "worker": "w0",
            "seq": 7,
            "ts": batch(7).ts,
            "recv_ts": 1.5,
            "type": "BlockStored",
            "block_hashes": [7000],
            "parent_block_hash": None,
            "token_ids": [0, 1, 2, 3],
            "block_size": 4,
            "medium": "GPU",
            "replayed": True,
            "dp_rank": 0,
            "group_idx": None,
            "lora_name": None,
        },
        {
            **common,
            "worker": "w0",
            "seq": 0,
            "ts": 2.5,
            "recv_ts": 2.5,
            "type": "reset",
            "reason": None,
        },
        {
            **common,
            "worker": "w1",
            "seq": None,
            "ts": 3.5,
            "recv_ts": 3.5,
            "type": "resync",
            "reason": "replay_timeout",
        },
        {
            **common,
            "worker": "w2",
            "seq": 3,
            "ts": 4.5,
            "recv_ts": 4.5,
            "type": "malformed",
            "reason": "msgpack",
        },
    ]
    assert events_main(["dump", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "2023-11-14T22:13:27.000+00:00 w0 #7 BlockStored blocks=1 [0000000000001b58] "
        "parent=- tokens=4 block_size=4 GPU (replayed)"
    )
    assert lines[1:] == [
        "1970-01-01T00:00:02.500+00:00 w0 #0 !! RESET",
        "1970-01-01T00:00:03.500+00:00 w1 #None !! RESYNC (replay_timeout)",
        "1970-01-01T00:00:04.500+00:00 w2 #3 !! MALFORMED (msgpack)",
    ]
    assert events_main(["dump", str(tmp_path / "missing.log")]) == 1


def test_bad_worker_spec_exits_2(tmp_path: Path) -> None:
    out = str(tmp_path / "x.log")
    assert record_main(["--worker", "w0", "--out", out]) == 2
    assert record_main(["--worker", "w0=tcp://127.0.0.1:1,bogus=1", "--out", out]) == 2
    assert record_main(["--worker", "w0=tcp://127.0.0.1:1,server_key=k", "--out", out]) == 2
    assert (
        events_main(["tail", "--worker", "a=tcp://127.0.0.1:1", "--worker", "a=tcp://127.0.0.1:2"])
        == 2
    )


def kvroute(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "router.cli.main", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def still_running(proc: subprocess.Popen[str], pause_s: float = 0.05) -> bool:
    """Wait up to ``pause_s`` for ``proc`` to exit (paces probe loops); True if it runs on."""
    try:
        proc.wait(timeout=pause_s)
    except subprocess.TimeoutExpired:
        return True
    return False


def intact_records(path: Path) -> list[LogRecord]:
    return list(read_log(path)) if path.exists() and path.stat().st_size else []


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_record_command_runs_until_signalled(tmp_path: Path, signum: int) -> None:
    path = tmp_path / "events.log"
    skipped: set[int] = set()
    with loopback_publisher(skip_live_seqs=skipped) as pub:
        spec = f"w0={pub.address},replay={pub.replay_address}"
        proc = kvroute("record", "--worker", spec, "--out", str(path), "--flush-interval-s", "0.05")
        try:
            deadline = time.monotonic() + DEADLINE_S
            while not intact_records(path):  # slow-joiner handshake through the log
                assert time.monotonic() < deadline
                pub.publish(batch(0))
                assert still_running(proc), proc.communicate()
            skipped.add(pub.next_seq + 2)
            for i in range(10):
                pub.publish(batch(i))
            last = pub.next_seq - 1
            while not intact_records(path) or intact_records(path)[-1].seq != last:
                assert time.monotonic() < deadline
                assert still_running(proc), proc.communicate()
            proc.send_signal(signum)
            _, stderr = proc.communicate(timeout=DEADLINE_S)
        finally:
            proc.kill()
    assert proc.returncode == 0, stderr
    seqs = [r.seq for r in read_log(path)]
    assert seqs == list(range(seqs[0], last + 1))
    assert "gap of 1 batches" in stderr


@pytest.mark.slow
def test_tail_command_prints_live_events() -> None:
    with loopback_publisher() as pub:
        proc = kvroute(
            "events", "tail", "--worker", f"w0={pub.address}", "--max-batches", "3", "--json"
        )
        try:
            deadline = time.monotonic() + DEADLINE_S
            while True:  # probe until tail exits by itself after --max-batches
                assert time.monotonic() < deadline
                pub.publish(batch(5))
                if not still_running(proc):
                    break
            stdout, stderr = proc.communicate(timeout=DEADLINE_S)
        finally:
            proc.kill()
    assert proc.returncode == 0, stderr
    rows = [json.loads(line) for line in stdout.splitlines()]
    assert len(rows) == 3
    assert {(r["worker"], r["type"], tuple(r["block_hashes"])) for r in rows} == {
        ("w0", "BlockStored", (5000,))
    }
