"""Tests of predicted entries: exact prefix credit, TTL, bounded memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import BlockKey
from events.identity import WorkerId
from router.cli.router_config import config_from_args
from router.cli.router_flags import build_parser
from router.front.service import RouterService
from router.routing.cost import CostConfigError
from router.routing.predicted import PredictedEntries

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")


def keys(*values: int) -> list[BlockKey]:
    return [BlockKey(v) for v in values]


def test_lookup_reports_each_workers_credited_prefix() -> None:
    p = PredictedEntries(ttl_s=10.0)
    p.credit(A, keys(1, 2, 3, 4), now_s=0.0)
    p.credit(B, keys(1, 2), now_s=0.0)
    p.credit(C, keys(2, 3), now_s=0.0)  # not a prefix of the request below
    assert p.lookup(keys(1, 2, 3, 9), [A, B, C], now_s=1.0) == {A: 3, B: 2}
    assert p.lookup(keys(1, 2, 3, 9), [B], now_s=1.0) == {B: 2}
    assert p.lookup(keys(7), [A, B, C], now_s=1.0) == {}
    assert p.lookup([], [A], now_s=1.0) == {}


def test_credits_expire_after_ttl_and_a_new_credit_extends_them() -> None:
    p = PredictedEntries(ttl_s=10.0)
    p.credit(A, keys(1, 2), now_s=0.0)
    p.credit(A, keys(1), now_s=5.0)
    assert p.lookup(keys(1, 2), [A], now_s=9.999) == {A: 2}
    assert p.lookup(keys(1, 2), [A], now_s=10.0) == {A: 1}
    assert len(p) == 1
    assert p.lookup(keys(1, 2), [A], now_s=15.0) == {}
    assert len(p) == 0


def test_memory_is_bounded_by_dropping_the_oldest_credits() -> None:
    p = PredictedEntries(ttl_s=100.0, max_entries=3)
    p.credit(A, keys(1, 2), now_s=0.0)
    p.credit(B, keys(1, 2), now_s=1.0)
    assert len(p) == 2  # the oldest credit (A's, two keys) went whole
    assert p.lookup(keys(1, 2), [A, B], now_s=2.0) == {B: 2}


def test_forget_drops_one_worker() -> None:
    p = PredictedEntries(ttl_s=100.0)
    p.credit(A, keys(1, 2), now_s=0.0)
    p.credit(B, keys(1), now_s=0.0)
    p.forget(A)
    assert p.lookup(keys(1, 2), [A, B], now_s=1.0) == {B: 1}
    assert len(p) == 1


def test_router_bounds_its_predicted_entries_by_its_flag() -> None:
    default = config_from_args(build_parser().parse_args([]), "redis://127.0.0.1:1/0")
    assert default.predicted_max_entries == 100_000
    args = build_parser().parse_args(["--predicted-max-entries", "4"])
    service = RouterService(config_from_args(args, "redis://127.0.0.1:1/0"))  # no I/O yet
    service.credit(A, keys(1, 2, 3))
    service.credit(B, keys(1, 2, 3))
    store = service._predicted  # the service's own store: no public handle on it
    assert store is not None and store.max_entries == 4
    assert len(store) == 3  # A's credit went whole to keep the store within 4 keys
    assert store.lookup(keys(1, 2, 3), [A, B], now_s=0.0) == {B: 3}


def test_settings_are_validated() -> None:
    with pytest.raises(CostConfigError, match="ttl_s"):
        PredictedEntries(ttl_s=0.0)
    with pytest.raises(CostConfigError, match="max_entries"):
        PredictedEntries(ttl_s=1.0, max_entries=0)


_ops = st.lists(
    st.tuples(
        st.sampled_from([A, B, C]),
        st.lists(st.integers(0, 5), min_size=1, max_size=5),
        st.floats(0.0, 4.0),
    ),
    max_size=30,
)



def chain(path: list[int]) -> list[BlockKey]:
    """Chained keys of a token path, as router keys are: key i names the whole prefix."""
    return [BlockKey(hash(tuple(path[: i + 1])) % 2**64) for i in range(len(path))]


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(ops=_ops, probe=st.lists(st.integers(0, 5), max_size=6))
def test_matches_a_naive_model_when_unbounded(
    ops: list[tuple[WorkerId, list[int], float]], probe: list[int]
) -> None:
    p = PredictedEntries(ttl_s=3.0)
    model: dict[tuple[BlockKey, WorkerId], float] = {}
    now = 0.0
    for worker, path, step in ops:
        now += step
        p.credit(worker, chain(path), now_s=now)
        for k in chain(path):
            model[(k, worker)] = now + 3.0
        expected = {}
        probe_keys = chain(probe)
        for w in (A, B, C):
            depth = 0
            while depth < len(probe_keys) and model.get((probe_keys[depth], w), 0.0) > now:
                depth += 1
            if depth:
                expected[w] = depth
        assert p.lookup(probe_keys, [A, B, C], now_s=now) == expected
