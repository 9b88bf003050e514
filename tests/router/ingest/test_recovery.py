"""The recovery rules (router.ingest.recovery): pure decisions, tested without Redis or sockets."""

from __future__ import annotations

import pytest

from events.schema import KVEventBatch
from events.subscription import ReceivedBatch
from router.ingest.recovery import (
    OFFLINE_RULES,
    KeptStream,
    Rebuild,
    RecoveryRules,
    Restart,
    Silence,
    StreamPosition,
)

KVROUTE = RecoveryRules(has_snapshot=True, can_replay=True)
VLLM = RecoveryRules(has_snapshot=False, can_replay=True)
NO_REPLAY = RecoveryRules(has_snapshot=False, can_replay=False)
SNAPSHOT_ONLY = RecoveryRules(has_snapshot=True, can_replay=False)


@pytest.mark.parametrize(
    ("rules", "expected"),
    [
        (KVROUTE, Rebuild.LOAD_SNAPSHOT),
        (VLLM, Rebuild.KEEP_FROM_NOW),
        (NO_REPLAY, Rebuild.KEEP_FROM_NOW),
        (OFFLINE_RULES, Rebuild.KEEP_FROM_NOW),
    ],
)
def test_a_loss_for_good_loads_the_snapshot_or_keeps_what_comes_next(
    rules: RecoveryRules, expected: Rebuild
) -> None:
    assert rules.after_loss() is expected


def test_an_orphan_replays_from_the_start_unless_that_cannot_help() -> None:
    assert KVROUTE.after_orphan(replaying=False) is Rebuild.REPLAY_FROM_START
    assert VLLM.after_orphan(replaying=False) is Rebuild.REPLAY_FROM_START
    # Met during a replay: replaying again would meet it again.
    assert KVROUTE.after_orphan(replaying=True) is Rebuild.LOAD_SNAPSHOT
    assert VLLM.after_orphan(replaying=True) is Rebuild.KEEP_FROM_NOW
    assert NO_REPLAY.after_orphan(replaying=False) is Rebuild.KEEP_FROM_NOW
    assert OFFLINE_RULES.after_orphan(replaying=False) is Rebuild.KEEP_FROM_NOW


def test_a_takeover_prefers_the_snapshot_and_replays_only_inside_a_batch() -> None:
    assert KVROUTE.after_takeover(in_batch=True) is Rebuild.LOAD_SNAPSHOT
    assert KVROUTE.after_takeover(in_batch=False) is Rebuild.LOAD_SNAPSHOT
    assert VLLM.after_takeover(in_batch=True) is Rebuild.REPLAY_FROM_START
    assert VLLM.after_takeover(in_batch=False) is Rebuild.KEEP_FROM_NOW
    assert NO_REPLAY.after_takeover(in_batch=True) is Rebuild.KEEP_FROM_NOW


def test_position_after_a_clear_expects_seq_0() -> None:
    position = StreamPosition()
    assert position.first_missing(0) is None
    assert position.first_missing(3) == 0
    assert not position.covers(0)


def test_position_tells_covered_batches_from_jumps() -> None:
    position = StreamPosition(applied_through=5)
    assert [position.covers(seq) for seq in (4, 5, 6)] == [True, True, False]
    assert [position.first_missing(seq) for seq in (5, 6, 7, 9)] == [None, None, 6, 6]


def test_position_sees_no_jump_while_unknown_or_replaying() -> None:
    assert StreamPosition(applied_through=None).first_missing(100) is None
    assert not StreamPosition(applied_through=None).covers(0)
    assert StreamPosition(applied_through=5, replaying=True).first_missing(100) is None


def test_position_tells_a_reused_seq_of_a_newer_lifetime() -> None:
    position = StreamPosition(applied_through=5, applied_ts=100.0)
    assert not position.restarted(5, 100.0)  # the same batch again (a duplicate, a replay)
    assert not position.restarted(3, 99.0)  # an earlier batch of the same lifetime
    assert position.restarted(3, 101.0)  # seq 3 again, stamped later: a new lifetime
    assert not position.restarted(6, 101.0)  # not covered: the next batch
    assert not StreamPosition(applied_through=5).restarted(3, 101.0)  # no stamp known


def _received(seq: int, ts: float) -> ReceivedBatch:
    return ReceivedBatch("w", seq, KVEventBatch(ts, []), b"", ts, False)


def _drained(kept: KeptStream) -> list[object]:
    out: list[object] = []
    while kept:
        item = kept.first()
        out.append(item if isinstance(item, Restart) else (item.seq, item.batch.ts))
        kept.pop()
    return out


def test_kept_stream_drops_what_the_previous_holder_applied() -> None:
    kept = KeptStream()
    for item in (_received(4, 4.0), Restart(0), _received(5, 5.0), _received(6, 6.0)):
        kept.add(item)
    kept.drop_through(5, 5.0)  # a restart before it was the previous holder's to see
    assert _drained(kept) == [(6, 6.0)]


def test_kept_stream_keeps_all_without_the_applied_batch() -> None:
    kept = KeptStream()
    for item in (_received(5, 9.0), Restart(0), _received(0, 10.0)):
        kept.add(item)
    kept.drop_through(5, 5.0)  # seq 5 of another lifetime (stamped 9.0) is not the one
    assert _drained(kept) == [(5, 9.0), Restart(0), (0, 10.0)]
    kept.add(_received(7, 7.0))
    kept.drop_through(None, None)  # nothing was applied: nothing to drop
    assert _drained(kept) == [(7, 7.0)]


def test_kept_stream_is_bounded_oldest_first() -> None:
    kept = KeptStream(capacity=3)
    for seq in range(5):
        kept.add(_received(seq, float(seq)))
    assert _drained(kept) == [(2, 2.0), (3, 3.0), (4, 4.0)]


@pytest.mark.parametrize(
    ("rules", "seen", "reported_next", "expected"),
    [
        (KVROUTE, 7, 8, Silence.CURRENT),  # the publisher's next seq follows the last seen
        (KVROUTE, 7, 5, Silence.CURRENT),  # (lower: batches in flight to it; not behind)
        (KVROUTE, 7, 10, Silence.CATCH_UP),
        (SNAPSHOT_ONLY, 7, 10, Silence.BEHIND),  # missed, nothing to replay them from
        (SNAPSHOT_ONLY, 7, 8, Silence.CURRENT),
        (KVROUTE, None, 10, Silence.CATCH_UP),  # position unknown: ask the replay
        (VLLM, 7, None, Silence.CATCH_UP),  # no next seq reported: only a replay can tell
        (NO_REPLAY, 7, None, Silence.UNKNOWN),
    ],
)
def test_a_quiet_stream_is_checked_against_the_publishers_position(
    rules: RecoveryRules, seen: int | None, reported_next: int | None, expected: Silence
) -> None:
    assert rules.after_silence(seen, "L1", "L1", reported_next) is expected


@pytest.mark.parametrize("rules", [KVROUTE, VLLM, NO_REPLAY, SNAPSHOT_ONLY])
def test_a_quiet_stream_under_a_new_lifetime_restarted(rules: RecoveryRules) -> None:
    assert rules.after_silence(7, "L1", "L2", 3) is Silence.RESTARTED
    assert rules.after_silence(7, "L1", "L2", None) is Silence.RESTARTED
    # No lifetime recorded, or none reported: not a restart (the seqs decide).
    assert rules.after_silence(7, None, "L2", 8) is Silence.CURRENT
    assert rules.after_silence(7, "L1", None, None) is not Silence.RESTARTED
