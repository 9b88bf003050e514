"""Worker liveness rules: retire after the grace period, revive on return, forget on purpose."""

from __future__ import annotations

from events.identity import WorkerId
from router.workers.liveness import Liveness
from router.workers.registry import WorkerRecord

A, B = WorkerId("a"), WorkerId("b")


def record(wid: str) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, events_endpoint="tcp://127.0.0.1:5557")


def test_a_worker_is_overdue_only_after_the_whole_grace_period_unanswered() -> None:
    live = Liveness(dead_after_s=10.0)
    down = {A}
    assert live.overdue([A, B], lambda w: w not in down, now=100.0) == []
    assert live.overdue([A, B], lambda w: w not in down, now=109.9) == []
    assert live.overdue([A, B], lambda w: w not in down, now=110.0) == [A]


def test_an_answer_in_between_restarts_the_grace_period() -> None:
    live = Liveness(dead_after_s=10.0)
    assert live.overdue([A], lambda w: False, now=0.0) == []
    assert live.overdue([A], lambda w: True, now=5.0) == []
    assert live.overdue([A], lambda w: False, now=12.0) == []
    assert live.overdue([A], lambda w: False, now=21.9) == []
    assert live.overdue([A], lambda w: False, now=22.0) == [A]


def test_retired_workers_are_kept_until_registered_again_or_forgotten() -> None:
    live = Liveness(dead_after_s=1.0)
    live.overdue([A, B], lambda w: False, now=0.0)
    live.retire(record("a"))
    live.retire(record("b"))
    assert (live.is_retired(A), [r.worker_id for r in live.retired]) == (True, ["a", "b"])
    # Retired: no longer counted as unreachable (a new registration starts afresh).
    assert live.overdue([B], lambda w: False, now=0.5) == []
    live.forget(A)
    assert (live.is_retired(A), [r.worker_id for r in live.retired]) == (False, ["b"])
