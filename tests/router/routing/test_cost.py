"""Tests of the pure cost model: exact scores, no cliff, the choice rule."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.load.model import WorkerLoad
from router.routing.cost import (
    CostConfigError,
    CostWeights,
    choose,
    replicated_blocks,
    score_candidate,
)

PLAIN = CostWeights(prefill=1.0, queued_prefill=1.0, decode=2.0, per_request=100.0)


def test_score_is_the_weighted_sum_of_work_terms() -> None:
    load = WorkerLoad(num_requests=3, queued_prefill_tokens=1000, decode_tokens=50)
    b = score_candidate(4096, 1024.0, load, PLAIN)
    assert b.cached_tokens == 1024.0
    assert b.prefill_tokens == 3072.0
    assert (b.queued_prefill_tokens, b.decode_tokens, b.num_requests) == (1000, 50, 3)
    assert b.score == 3072.0 + 1000.0 + 2.0 * 50 + 100.0 * 3


def test_the_last_prompt_token_is_always_computed() -> None:
    b = score_candidate(1024, 1024.0, WorkerLoad(), PLAIN)
    assert b.cached_tokens == 1023.0
    assert b.prefill_tokens == 1.0
    assert score_candidate(0, 512.0, WorkerLoad(), PLAIN).prefill_tokens == 0.0


def test_cached_prefix_is_worth_exactly_its_tokens_no_cliff() -> None:
    # Worker A caches 2048 of 4096 tokens; B caches nothing. A computed token costs 2 and
    # a queued one 1, so A keeps winning while its extra queue is below 2 x 2048 tokens,
    # and loses right after: no threshold at which the cache suddenly stops counting.
    weights = CostWeights(prefill=2.0, queued_prefill=1.0, per_request=0.0, decode=0.0)
    for queued in (0, 2000, 4095, 4096, 4097, 9000):
        a = score_candidate(4096, 2048.0, WorkerLoad(1, queued, 0), weights).score
        b = score_candidate(4096, 0.0, WorkerLoad(), weights).score
        assert a - b == queued - 4096


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    prompt=st.integers(0, 100_000),
    cached=st.floats(0, 100_000),
    more_cached=st.floats(0, 10_000),
    load=st.tuples(st.integers(0, 50), st.integers(0, 10**6), st.integers(0, 10**5)),
    extra=st.tuples(st.integers(0, 5), st.integers(0, 10**4), st.integers(0, 10**3)),
)
def test_score_rises_with_load_and_falls_with_cache(
    prompt: int,
    cached: float,
    more_cached: float,
    load: tuple[int, int, int],
    extra: tuple[int, int, int],
) -> None:
    base = WorkerLoad(*load)
    score = score_candidate(prompt, cached, base, CostWeights()).score
    busier = score_candidate(prompt, cached, base + WorkerLoad(*extra), CostWeights()).score
    warmer = score_candidate(prompt, cached + more_cached, base, CostWeights()).score
    assert busier >= score >= warmer


def test_cpu_hit_weight_and_temperature_are_validated() -> None:
    with pytest.raises(CostConfigError, match="cpu_hit"):
        CostWeights(cpu_hit=1.5)
    with pytest.raises(CostConfigError, match="decode"):
        CostWeights(decode=-1.0)
    with pytest.raises(CostConfigError, match="temperature"):
        CostWeights(temperature=float("nan"))


def test_choose_without_temperature_takes_the_best_and_rotates_ties() -> None:
    assert choose([5.0, 3.0, 4.0], temperature=0.0, scale=1.0) == 1
    picks = [
        choose([3.0, 9.0, 3.0, 3.0], temperature=0.0, scale=1.0, tie_break=t) for t in range(6)
    ]
    assert picks == [0, 2, 3, 0, 2, 3]


def test_choose_with_temperature_samples_near_best_only() -> None:
    rng = random.Random(7)
    # Scale 1000 tokens, temperature 0.1: widths of 100 tokens. Candidate 1 is 10 widths
    # worse than the best (e^-10), candidate 2 ties with the best.
    counts = [0, 0, 0]
    for _ in range(2000):
        counts[choose([0.0, 1000.0, 0.0], temperature=0.1, scale=1000.0, rng=rng)] += 1
    assert counts[1] <= 2
    assert 900 <= counts[0] <= 1100 and 900 <= counts[2] <= 1100


def test_replicated_blocks_are_those_below_the_kth_longest_other_prefix() -> None:
    assert replicated_blocks([5, 3, 0, 1], holders=2) == [0, 0, 3, 2]
    assert replicated_blocks([5, 3, 0, 1], holders=1) == [0, 2, 5, 4]
    assert replicated_blocks([5, 3], holders=3) == [0, 0]
    assert replicated_blocks([], holders=2) == []


def test_a_widely_held_prefix_costs_only_the_replicated_weight_to_acquire() -> None:
    weights = CostWeights(prefill=8.0, replicated_prefill=1.0, per_request=0.0, decode=0.0)
    plain = score_candidate(2048, 0.0, WorkerLoad(), weights)
    shared = score_candidate(2048, 0.0, WorkerLoad(), weights, replicated_tokens=1024.0)
    assert (plain.score, shared.score) == (8.0 * 2048, 8.0 * 1024 + 1.0 * 1024)
    assert shared.replicated_tokens == 1024.0
    # Never more than what the candidate computes.
    capped = score_candidate(2048, 1536.0, WorkerLoad(), weights, replicated_tokens=1024.0)
    assert capped.replicated_tokens == 512.0
    with pytest.raises(CostConfigError, match="replicated_holders"):
        CostWeights(replicated_holders=0)
