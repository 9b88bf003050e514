"""The fair-share term: recent work per worker, its excess over the mean, its effect."""

from __future__ import annotations

import asyncio

import pytest

from events.identity import WorkerId
from router.cli.sim import pool_cache_factory
from router.load.model import WorkerLoad
from router.routing.cost import (
    PRIOR_REQUESTS,
    CostConfigError,
    CostWeights,
    RecentWork,
    score_candidates,
)
from router.routing.policies import PolicyConfig, make_policy
from router.routing.share import WorkShares
from router.sim.bounds import pooled_lru_hits
from router.sim.engine import SimConfig, simulate
from router.sim.report import summarize
from router.sim.synthetic import chat_sessions
from router.sim.trace import ideal_hits, to_requests

A, B = WorkerId("a"), WorkerId("b")


def test_recent_work_halves_every_half_life_and_is_forgotten_on_request() -> None:
    shares = WorkShares(half_life_s=10.0)
    assert shares.snapshot([A], 0.0) == {}  # nothing recorded: no fair-share term at all
    shares.add(A, 1000, now_s=0.0)
    shares.add(A, 600, now_s=10.0)
    assert shares.snapshot([A, B], 10.0) == {A: RecentWork(1.5, 1100.0), B: RecentWork()}
    assert shares.snapshot([A], 30.0) == {A: RecentWork(0.375, 275.0)}
    shares.forget(A)
    assert shares.snapshot([A], 30.0) == {}


def test_a_clock_far_past_the_origin_keeps_the_figures_exact() -> None:
    shares = WorkShares(half_life_s=1.0)
    shares.add(A, 100, now_s=0.0)
    shares.add(B, 100, now_s=300.0)  # 300 half-lives: the origin moves, A's work is gone
    shares.add(B, 100, now_s=301.0)
    snapshot = shares.snapshot([A, B], 301.0)
    assert snapshot[B] == RecentWork(1.5, 150.0)
    assert snapshot[A].requests == 2.0**-301 and snapshot[A].prefill_tokens == 100 * 2.0**-301
    with pytest.raises(CostConfigError, match="half-life"):
        WorkShares(half_life_s=0.0)


def _excess(recent: list[RecentWork], prompt: int, cached: list[float]) -> list[float]:
    weights = CostWeights(balance_factor=1.1)
    loads = [WorkerLoad()] * len(recent)
    costs = score_candidates(prompt, cached, [0.0] * len(recent), loads, weights, None, recent)
    return [c.excess_share for c in costs]


def test_excess_share_counts_this_request_and_a_prior_of_typical_requests() -> None:
    n, c = 4, 1.1
    # 40 recent requests of 1,000 tokens, 16 of them on worker 0; this one adds 1,000.
    recent = [RecentWork(16.0, 16_000.0)] + [RecentWork(8.0, 8000.0)] * 3
    mean_requests = 41 / n + PRIOR_REQUESTS
    by_requests = (16 + 1 + PRIOR_REQUESTS) / mean_requests - c
    mean_tokens = 41_000 / n + PRIOR_REQUESTS * 1000
    by_tokens = (17_000 + PRIOR_REQUESTS * 1000) / mean_tokens - c
    busy, *others = _excess(recent, 1000, [0.0] * n)  # computes 1,000
    assert busy == pytest.approx(by_requests + by_tokens)
    assert others == [0.0] * 3  # at or below the mean share: nothing
    # A request adding little computation (a hit) is charged for the request share, and
    # for the token share only in proportion to what it adds.
    hit, *_ = _excess(recent, 1000, [990.0] * n)  # computes 10 tokens
    assert by_requests < hit < by_requests + 0.05 * by_tokens
    # A handful of requests barely reads as an imbalance: the third of three on one worker
    # is charged 0.31 of a unit (2 x (11 / 8.75 - 1.1)) instead of 2 x (4 - 1.1) without
    # the prior, which would push even a long shared prefix off its holder.
    few, *_ = _excess([RecentWork(2.0, 2000.0)] + [RecentWork()] * 3, 1000, [0.0] * n)
    assert few == pytest.approx(2 * (11 / 8.75 - c))


def test_the_share_term_is_one_term_of_the_score_and_charged_per_prompt_up_to_the_unit() -> None:
    weights = CostWeights(prefill=8.0, fair_share=2048.0)
    busy, idle = RecentWork(30.0, 30_000.0), RecentWork(2.0, 2000.0)
    for prompt in (512, 4096):
        costs = score_candidates(
            prompt,
            [0.0, 0.0],
            [0.0, 0.0],
            [WorkerLoad(), WorkerLoad()],
            weights,
            None,
            [busy, idle],
        )
        assert costs[0].excess_share > 0 == costs[1].excess_share
        assert costs[0].recent_requests == 30.0 and costs[0].recent_prefill_tokens == 30_000.0
        unit = min(prompt, 2048)
        assert costs[0].share_unit(weights) == unit
        assert costs[0].score == 8.0 * prompt + 8.0 * unit * costs[0].excess_share
        assert sum(amount * w for _, amount, w in costs[0].terms(weights)) == costs[0].score
    # Without recent work (no record, or fair_share 0) there is no such term.
    plain = score_candidates(512, [0.0], [0.0], [WorkerLoad()], weights, None, [RecentWork()])
    assert plain[0].excess_share == 0.0
    with pytest.raises(CostConfigError, match="balance_factor"):
        CostWeights(balance_factor=0.9)


def _chats(fair_share: float) -> tuple[tuple[int, ...], int, float]:
    reqs = to_requests(chat_sessions(num_sessions=300, session_gap_s=0.5, seed=1))
    weights = CostWeights(fair_share=fair_share)
    config = SimConfig(num_workers=4, capacity_blocks=200, policy=PolicyConfig(weights=weights))
    outcomes = asyncio.run(
        simulate(reqs, make_policy("cache_aware", config.policy), config, pool_cache_factory())
    )
    bound = pooled_lru_hits(reqs, 4 * 200 * 512)
    result = summarize("cache_aware", reqs, outcomes, ideal_hits(reqs), 4, 0.0, 0.0, bound)
    return result.requests_per_worker, result.num_hit_blocks, result.load_imbalance


def test_sessions_of_a_popular_system_prompt_spread_without_losing_hits() -> None:
    # Chat sessions over Zipf-popular system prompts (2,957 distinct blocks, 800 blocks of
    # cache). Without the term the workers caching the popular prompts take their
    # sessions and every next turn: one serves 425 of 1,005 requests. With it, new
    # sessions go where the share is low while continuing ones keep their history.
    spread = _chats(CostWeights().fair_share)
    piled = _chats(0.0)
    assert piled[0] == (167, 425, 206, 207)
    assert spread[0] == (257, 329, 224, 195)
    assert spread[2] < 1.31 < 1.76 < piled[2]
    assert spread[1] >= piled[1]  # 11,061 against 10,943 hit blocks
