"""Tests of the routing policies: exact choices, explanations and balance."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from router.index.base import PrefixMatch
from router.load.model import MemoryLoadTracker, WorkerLoad, finished, prefilled, routed
from router.routing.cost import CostConfigError, CostWeights
from router.routing.decider import DecisionInputs, decide
from router.routing.policies import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    Candidate,
    PolicyConfig,
    RouteRequest,
    build_candidates,
    make_policy,
)
from router.routing.share import WorkShares

BS = 16
W = [WorkerId(f"w{i}") for i in range(4)]
KEYER = RouterKeyer(seed=1)


def request(tokens: list[int], output: int = 0) -> RouteRequest:
    return RouteRequest(KEYER.keys(tokens, BS), len(tokens), BS, output)


def test_every_name_builds_a_policy_of_that_name() -> None:
    assert DEFAULT_POLICY == "cache_aware"
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(CostConfigError, match="unknown policy 'nope'"):
        make_policy("nope")


def test_cache_aware_prefers_the_longest_prefix_and_explains_itself() -> None:
    policy = make_policy(
        "cache_aware", PolicyConfig(weights=CostWeights(prefill=1.0, per_request=10.0))
    )
    req = request(list(range(64)))
    candidates = build_candidates(
        W[:3],
        {W[0]: WorkerLoad(1, 0, 0)},
        matches={W[0]: PrefixMatch(3, 3, 0), W[1]: PrefixMatch(1, 1, 0)},
        predicted={W[2]: 2},
    )
    d = policy.decide(req, candidates)
    assert d.worker_id == W[0]
    assert d.policy == "cache_aware"
    assert d.prefill_tokens == 16
    assert [(c.worker_id, c.matched_tokens, c.predicted_tokens, c.score) for c in d.candidates] == [
        (W[0], 48, 48, 16.0 + 10.0),
        (W[1], 16, 16, 48.0),
        (W[2], 0, 32, 32.0),
    ]
    assert d.chosen.load == WorkerLoad(1, 0, 0)


def test_cache_aware_weighs_cpu_tier_blocks() -> None:
    policy = make_policy(
        "cache_aware", PolicyConfig(weights=CostWeights(prefill=1.0, cpu_hit=0.25))
    )
    req = request(list(range(64)))
    candidates = build_candidates(
        W[:2], {}, matches={W[0]: PrefixMatch(3, 1, 2), W[1]: PrefixMatch(2, 2, 0)}
    )
    d = policy.decide(req, candidates)
    assert [c.score for c in d.candidates] == [64 - 16 - 0.25 * 32, 64 - 32]
    assert d.worker_id == W[1]


def test_cache_aware_leaves_a_cached_worker_once_its_queue_outweighs_the_saving() -> None:
    weights = CostWeights(prefill=2.0, per_request=0.0)
    policy = make_policy("cache_aware", PolicyConfig(weights=weights))
    req = request(list(range(64)))
    # w0 saves 48 tokens, worth 2 x 48 tokens of queue with these weights.
    matches = {W[0]: PrefixMatch(3, 3, 0)}
    stays = policy.decide(req, build_candidates(W[:2], {W[0]: WorkerLoad(1, 95, 0)}, matches))
    leaves = policy.decide(req, build_candidates(W[:2], {W[0]: WorkerLoad(1, 97, 0)}, matches))
    assert (stays.worker_id, leaves.worker_id) == (W[0], W[1])


def test_approximate_sees_only_its_route_history() -> None:
    policy = make_policy("approximate")
    assert not policy.uses_index and policy.credit_ttl_s == PolicyConfig().history_ttl_s
    req = request(list(range(64)))
    d = policy.decide(
        req, build_candidates(W[:2], {}, matches={W[0]: PrefixMatch(4, 4, 0)}, predicted={W[1]: 1})
    )
    assert d.worker_id == W[1]
    assert [c.matched_tokens for c in d.candidates] == [64, 0]


def _route_burst(
    policy_name: str,
    reqs: list[RouteRequest],
    matches: dict[WorkerId, PrefixMatch],
    learned: PrefixMatch | None = None,
) -> Counter[WorkerId]:
    """Route requests one after another, as the router does (load and recent work
    recorded after each decision), never finishing any.

    With ``learned``, a worker that gets a request caches that prefix from then on.
    """
    policy = make_policy(policy_name)
    tracker = MemoryLoadTracker()
    shares = WorkShares(CostWeights().fair_share_half_life_s)

    async def run() -> Counter[WorkerId]:
        counts: Counter[WorkerId] = Counter()
        for req in reqs:
            loads = await tracker.snapshot(W)
            inputs = DecisionInputs(req, W, loads, matches, recent=shares.snapshot(W, 0.0))
            d = decide(policy, inputs)
            await tracker.add(d.worker_id, routed(d.prefill_tokens, req.num_output_tokens))
            shares.add(d.worker_id, d.prefill_tokens, 0.0)
            counts[d.worker_id] += 1
            if learned is not None:
                matches[d.worker_id] = learned
        return counts

    return asyncio.run(run())


def test_a_system_prompt_one_worker_caches_does_not_pile_everything_on_it() -> None:
    # A burst of 200 requests shares a 2,048-token system prompt that only w0 caches.
    system = list(range(2048))
    reqs = [request(system + [5000 + i] * 64, output=100) for i in range(200)]
    system_match = PrefixMatch(128, 128, 0)
    # Realistic case: a worker caches the system prompt once it computed it (predicted
    # entries credit it at once). Another worker gets a request as soon as w0's load and
    # its share of the recent requests outweigh computing the prompt there (32 x 2,112
    # tokens); from then on both hold it and the burst spreads over every worker, w0
    # keeping only its head start.
    learning = _route_burst("cache_aware", reqs, {W[0]: system_match}, learned=system_match)
    assert learning == {W[0]: 64, W[1]: 45, W[2]: 46, W[3]: 45}
    # Worst case: the others never learn it, so each of their requests computes 2,112
    # tokens against w0's 64. w0 takes most requests, but its growing load and share
    # still send every other worker a share; there is no point where the cache stops
    # counting.
    static = _route_burst("cache_aware", reqs, {W[0]: system_match})
    assert static == {W[0]: 134, W[1]: 22, W[2]: 22, W[3]: 22}


def test_a_system_prompt_every_worker_caches_spreads_evenly() -> None:
    system = list(range(2048))
    reqs = [request(system + [5000 + i] * 64, output=100) for i in range(64)]
    everyone = {w: PrefixMatch(128, 128, 0) for w in W}
    assert _route_burst("cache_aware", reqs, everyone) == {w: 16 for w in W}


def test_round_robin_random_and_least_loaded() -> None:
    req = request(list(range(32)))
    cands = build_candidates(W, {W[0]: WorkerLoad(2, 0, 0), W[2]: WorkerLoad(1, 0, 0)})
    rr = make_policy("round_robin")
    assert [rr.decide(req, cands).worker_id for _ in range(5)] == [W[0], W[1], W[2], W[3], W[0]]
    seq = [
        make_policy("random", PolicyConfig(seed=3)).decide(req, cands).worker_id for _ in range(2)
    ]
    assert seq[0] == seq[1]
    rnd = make_policy("random", PolicyConfig(seed=3))
    assert set(rnd.decide(req, cands).worker_id for _ in range(200)) == set(W)
    ll = make_policy("least_loaded")
    picks = [ll.decide(req, cands) for _ in range(4)]
    assert [d.worker_id for d in picks] == [W[1], W[3], W[1], W[3]]
    assert [c.score for c in picks[0].candidates] == [2.0, 0.0, 1.0, 0.0]


def test_consistent_hash_is_sticky_per_prefix_and_bounded() -> None:
    policy = make_policy("consistent_hash", PolicyConfig(hash_load_factor=1.25))
    family = [request([7] * 32 + [i] * 16) for i in range(10)]  # sharing 2 blocks
    idle = build_candidates(W, {})
    owners = {policy.decide(r, idle).worker_id for r in family}
    assert len(owners) == 1
    owner = owners.pop()
    # With the owner at the bound (ceil(1.25 * 5 / 4) = 2 after this request), it moves on.
    loads = {w: WorkerLoad(1, 0, 0) for w in W}
    loads[owner] = WorkerLoad(2, 0, 0)
    moved = policy.decide(family[0], build_candidates(W, loads))
    assert moved.worker_id != owner
    # Under any sequence of routed requests, no worker exceeds the bound.
    counts = _route_burst("consistent_hash", [request([3] * 16)] * 40, {})
    assert max(counts.values()) <= 13  # ceil(1.25 * 40 / 4)
    # A prompt without a full block goes to the least loaded worker.
    assert policy.decide(request([1, 2]), build_candidates(W, loads)).worker_id != owner


def test_consistent_hash_keeps_most_prefixes_when_a_worker_leaves() -> None:
    policy = make_policy("consistent_hash")
    reqs = [request([i] * 16) for i in range(200)]
    before = [policy.decide(r, build_candidates(W, {})).worker_id for r in reqs]
    after = [policy.decide(r, build_candidates(W[:3], {})).worker_id for r in reqs]
    moved = [b for b, a in zip(before, after, strict=True) if a != b]
    assert set(moved) == {W[3]}


def test_candidate_defaults() -> None:
    c = Candidate(WorkerId("x"))
    assert (c.load, c.match, c.num_predicted_blocks) == (WorkerLoad(), PrefixMatch(), 0)
    assert BlockKey(1) == 1


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    in_flight=st.lists(st.integers(0, 20), min_size=1, max_size=8),
    key=st.integers(0, 2**64 - 1),
    factor=st.floats(1.0, 2.0),
)
def test_consistent_hash_never_exceeds_its_load_bound(
    in_flight: list[int], key: int, factor: float
) -> None:
    policy = make_policy("consistent_hash", PolicyConfig(hash_load_factor=factor))
    workers = [WorkerId(f"h{i}") for i in range(len(in_flight))]
    loads = {w: WorkerLoad(n, 0, 0) for w, n in zip(workers, in_flight, strict=True)}
    req = RouteRequest([BlockKey(key)], 16, 16)
    chosen = policy.decide(req, build_candidates(workers, loads)).worker_id
    bound = math.ceil(factor * (sum(in_flight) + 1) / len(workers))
    assert loads[chosen].num_requests + 1 <= bound


def test_memory_load_tracker_follows_a_request_and_never_goes_negative() -> None:
    tracker = MemoryLoadTracker()

    async def scenario() -> None:
        await tracker.add(W[0], routed(prefill_tokens=300, decode_tokens=20))
        await tracker.add(W[0], routed(prefill_tokens=100, decode_tokens=5))
        assert await tracker.snapshot([W[0], W[1]]) == {
            W[0]: WorkerLoad(2, 400, 25),
            W[1]: WorkerLoad(),
        }
        await tracker.add(W[0], prefilled(300))
        await tracker.add(W[0], finished(20))
        assert (await tracker.snapshot([W[0]]))[W[0]] == WorkerLoad(1, 100, 5)
        await tracker.forget(W[0])
        await tracker.add(W[0], finished(5))  # a late update for a forgotten request
        assert (await tracker.snapshot([W[0]]))[W[0]] == WorkerLoad()

    asyncio.run(scenario())


def test_a_prefix_two_workers_hold_is_cheap_for_a_third_to_acquire() -> None:
    policy = make_policy("cache_aware")
    req = request(list(range(64)))  # 4 blocks; the first 3 are a shared prefix
    busy = {W[0]: WorkerLoad(1, 0, 0), W[1]: WorkerLoad(1, 0, 0)}
    held = PrefixMatch(3, 3, 0)
    p = CostWeights().prefill
    # One holder: computing the prefix elsewhere costs p per token, so w0 keeps it
    # (p x 16 + 256 for its request in flight, against p x 64).
    one = policy.decide(req, build_candidates(W[:3], busy, {W[0]: held}))
    assert one.worker_id == W[0]
    assert [c.score for c in one.candidates] == [p * 16 + 256, 256 + p * 64, p * 64]
    # Two holders: it is replicated, the idle w2 pays 1 per token to acquire it.
    two = policy.decide(req, build_candidates(W[:3], busy, {W[0]: held, W[1]: held}))
    assert two.worker_id == W[2]
    assert [c.score for c in two.candidates] == [p * 16 + 256, p * 16 + 256, p * 16 + 48]
