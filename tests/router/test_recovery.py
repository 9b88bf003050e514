"""The recovery rules (router.recovery): pure decisions, tested without Redis or sockets."""

from __future__ import annotations

import pytest

from router.recovery import OFFLINE_RULES, Rebuild, RecoveryRules, StreamPosition

KVROUTE = RecoveryRules(has_snapshot=True, can_replay=True)
VLLM = RecoveryRules(has_snapshot=False, can_replay=True)
NO_REPLAY = RecoveryRules(has_snapshot=False, can_replay=False)


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
