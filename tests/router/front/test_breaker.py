"""Per-worker circuits: opened by repeated or unreachable failures, one trial after the cooldown."""

from __future__ import annotations

import pytest

from events.identity import WorkerId
from router.errors import RouterError
from router.front.breaker import BreakerConfig, CircuitBreakers, CircuitState, CircuitView

W = WorkerId("w0")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breakers(threshold: int = 3, cooldown_s: float = 5.0) -> tuple[CircuitBreakers, Clock, list]:
    clock = Clock()
    opened: list[WorkerId] = []
    config = BreakerConfig(failure_threshold=threshold, cooldown_s=cooldown_s)
    return CircuitBreakers(config, on_open=opened.append, clock=clock), clock, opened


def test_consecutive_failures_open_the_circuit_and_a_success_resets_the_count() -> None:
    b, _, opened = breakers(threshold=3)
    assert b.state(W) is CircuitState.CLOSED and b.admit(W)
    b.failed(W)
    b.failed(W)
    b.succeeded(W)  # not consecutive any more
    b.failed(W)
    b.failed(W)
    assert b.state(W) is CircuitState.CLOSED and b.routable(W)
    assert b.view(W) == CircuitView(CircuitState.CLOSED, 2, None)
    b.failed(W)
    assert b.state(W) is CircuitState.OPEN
    assert not b.routable(W) and not b.admit(W)
    assert b.view(W) == CircuitView(CircuitState.OPEN, 3, 5.0)
    assert opened == [W]


def test_an_unreachable_worker_opens_at_once() -> None:
    b, _, opened = breakers(threshold=3)
    b.failed(W, unreachable=True)
    assert b.state(W) is CircuitState.OPEN
    assert opened == [W]
    assert b.state(WorkerId("other")) is CircuitState.CLOSED  # circuits are per worker


def test_after_the_cooldown_one_trial_goes_through_and_its_success_closes() -> None:
    b, clock, _ = breakers(cooldown_s=5.0)
    b.failed(W, unreachable=True)
    clock.now += 4.9
    assert b.state(W) is CircuitState.OPEN and not b.admit(W)
    assert b.view(W).retry_in_s == pytest.approx(0.1)
    clock.now += 0.1
    assert b.state(W) is CircuitState.HALF_OPEN and b.routable(W)
    assert b.admit(W)  # the trial
    assert not b.routable(W) and not b.admit(W)  # one at a time
    b.succeeded(W)
    assert b.state(W) is CircuitState.CLOSED
    assert b.view(W) == CircuitView(CircuitState.CLOSED, 0, None)


def test_a_failed_trial_opens_again_for_a_full_cooldown() -> None:
    b, clock, opened = breakers(threshold=3, cooldown_s=5.0)
    b.failed(W, unreachable=True)
    clock.now += 5.0
    assert b.admit(W)
    b.failed(W)  # a plain failure suffices while not closed
    assert b.state(W) is CircuitState.OPEN
    assert b.view(W).retry_in_s == 5.0
    assert opened == [W, W]


def test_a_released_trial_lets_the_next_one_through_and_forget_closes() -> None:
    b, clock, _ = breakers()
    b.failed(W, unreachable=True)
    clock.now += 5.0
    assert b.admit(W)
    b.released(W)  # its client left: no verdict
    assert b.state(W) is CircuitState.HALF_OPEN and b.admit(W)
    b.forget(W)
    assert b.state(W) is CircuitState.CLOSED and b.view(W).consecutive_failures == 0


@pytest.mark.parametrize(
    ("threshold", "cooldown_s", "message"),
    [(0, 5.0, "threshold must be >= 1"), (3, 0.0, "cooldown must be > 0 s")],
)
def test_bad_settings_are_refused(threshold: int, cooldown_s: float, message: str) -> None:
    with pytest.raises(RouterError, match=message):
        BreakerConfig(failure_threshold=threshold, cooldown_s=cooldown_s)
