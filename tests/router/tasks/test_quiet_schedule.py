"""QuietSchedule: due at once when new, backing off while answers stay the same."""

from __future__ import annotations

from router.tasks.quiet_schedule import QuietSchedule


def test_a_quiet_key_backs_off_to_the_cap_and_any_change_resets_it() -> None:
    schedule: QuietSchedule[str] = QuietSchedule(1.0, 8.0)
    assert schedule.due(["a", "b"], 0.0) == ["a", "b"]  # never observed: due at once
    now, intervals = 0.0, []
    for _ in range(6):
        schedule.observed("a", "same", now)
        nxt = next(t / 4 for t in range(1, 1000) if schedule.due(["a"], now + t / 4))
        intervals.append(nxt)
        now += nxt
    assert intervals == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    schedule.observed("a", "changed", now)
    assert not schedule.due(["a"], now + 0.99) and schedule.due(["a"], now + 1.0)


def test_an_unhealthy_answer_keeps_the_base_interval_and_forget_makes_a_key_due() -> None:
    schedule: QuietSchedule[str] = QuietSchedule(0.5, 10.0)
    for t in range(5):
        schedule.observed("w", None, t * 0.5, healthy=False)
    assert schedule.due(["w"], 2.0 + 0.5) == ["w"]  # never backed off
    schedule.observed("w", "ok", 3.0)
    schedule.observed("w", "ok", 3.5)  # 1.0 now
    assert schedule.due(["w"], 4.0) == []
    schedule.forget("w")
    assert schedule.due(["w"], 4.0) == ["w"]
    assert QuietSchedule(2.0, 1.0).max_s == 2.0  # the cap is never below the base
