"""The one decision path: explain and the simulator make exactly the live decision.

The router service, the simulator and ``kvroute explain`` each gather inputs and call
:func:`router.routing.decider.decide`. These tests hold the shells to it: explain, given
the index the router saw and the router's decision record, reports the live decision's
scores and cost terms for any candidates, loads and prefixes under every policy; the
simulator's decisions are the decider's on the inputs it gathered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.schema import KVEventBatch
from router.cli.sim import pool_cache_factory
from router.index.base import PrefixMatch
from router.index.memory import MemoryPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.load.model import WorkerLoad
from router.offline.explain import RecordedDecision, explain_request
from router.routing.cost import CostWeights, RecentWork
from router.routing.decider import DecisionInputs, decide
from router.routing.policies import (
    POLICY_NAMES,
    Decision,
    PolicyConfig,
    RouteRequest,
    build_candidates,
    make_policy,
)
from router.routing.sessions import with_session_bonus
from router.sim.engine import SimConfig, simulate
from router.sim.trace import to_requests
from tests.support.chains import BS, stored
from tests.support.traces import rec

TOKENS = list(range(7000, 7000 + 6 * BS + 5))  # six full blocks and five tokens
KEYS = RouterKeyer().keys(TOKENS, BS)
WORKERS = [WorkerId(f"w{i}") for i in range(5)]


def test_the_decision_carries_every_cost_term_and_the_fallback_order() -> None:
    weights = CostWeights(prefill=8.0, replicated_prefill=1.0, per_request=100.0)
    policy = make_policy("cache_aware", PolicyConfig(weights=weights))
    inputs = DecisionInputs(
        RouteRequest(KEYS, len(TOKENS), BS, 8),
        WORKERS[:3],
        {WORKERS[0]: WorkerLoad(2, 40, 16)},
        matches={WORKERS[0]: PrefixMatch(4, 4, 0), WORKERS[1]: PrefixMatch(3, 2, 1)},
        predicted={WORKERS[2]: 1},
    )
    d = decide(policy, inputs)
    assert d.weights == weights
    assert [(c.cached_tokens, c.prefill_tokens, c.replicated_tokens) for c in d.costs] == [
        (64.0, 37.0, 0.0),
        (40.0, 61.0, 0.0),  # its CPU block saves half of its tokens
        (16.0, 85.0, 32.0),  # blocks 1-2: held by both others, so charged as replicated
    ]
    assert [c.credited_tokens for c in d.costs] == [0, 0, 16]
    assert [c.score for c in d.costs] == [c.score for c in d.candidates]
    for cost in d.costs:  # the terms add up to the score, in order
        assert sum(tokens * w for _, tokens, w in cost.terms(weights)) == cost.score
    assert [c.score for c in d.costs] == [8 * 37 + 40 + 16 + 100 * 2, 8 * 61, 8 * 53 + 32]
    assert d.worker_id == WORKERS[2] and d.prefill_tokens == 85
    assert [c.worker_id for c in d.ranked()] == [WORKERS[2], WORKERS[1], WORKERS[0]]
    assert d.costs_by_worker()[WORKERS[2]] is d.costs[2]


def test_policies_without_a_cost_model_carry_no_costs() -> None:
    inputs = DecisionInputs(RouteRequest(KEYS, len(TOKENS), BS), WORKERS[:2], {})
    for name in ("round_robin", "random", "least_loaded", "consistent_hash"):
        d = decide(make_policy(name), inputs)
        assert (d.costs, d.weights, d.costs_by_worker()) == ((), None, {})


# -- property: explain re-makes exactly the live decision ---------------------------------

candidate = st.tuples(
    st.integers(0, 6),  # blocks of the prompt it caches
    st.integers(0, 6),  # of which on CPU (the tail)
    st.integers(0, 6),  # blocks predicted entries credit it with
    st.tuples(st.integers(0, 8), st.integers(0, 5000), st.integers(0, 800)),  # load
    st.tuples(st.floats(0, 50), st.floats(0, 50_000)),  # recent requests, prefill tokens
)


def _index(prefixes: Sequence[tuple[int, int]]) -> MemoryPrefixIndex:
    store = MemoryPrefixIndex()
    index = BridgedIndex(store)

    async def fill() -> None:
        for w, (blocks, cpu) in zip(WORKERS, prefixes, strict=False):
            gpu = blocks - min(cpu, blocks)
            for first, last, medium in ((0, gpu, "GPU"), (gpu, blocks, "CPU")):
                if last > first:
                    event = stored(TOKENS, first, last, medium)
                    await index.apply(w, KVEventBatch(ts=1.0, events=[event]))

    asyncio.run(fill())
    return store


def _logged(decision: Decision, num_prompt_tokens: int) -> RecordedDecision:
    """The decision as the router's decision log holds it, read back as explain reads it."""
    line = msgspec.json.encode(
        {
            "ts": 2.0,
            "worker_id": decision.worker_id,
            "policy": decision.policy,
            "num_prompt_tokens": num_prompt_tokens,
            "index_live": True,
            "candidates": decision.candidates,
            "costs": decision.costs,
            "weights": decision.weights,
        }
    )
    return msgspec.json.decode(line, type=RecordedDecision)


@settings(max_examples=60, deadline=None)
@given(
    cands=st.lists(candidate, min_size=1, max_size=len(WORKERS)),
    policy=st.sampled_from(POLICY_NAMES),
    seed=st.integers(0, 2**16),
    num_output_tokens=st.integers(0, 64),
    session=st.tuples(st.integers(0, len(WORKERS)), st.integers(1, 64)),  # worker (or none)
)
def test_explain_costs_equal_the_live_decision_for_any_candidates(
    cands: list[tuple[int, int, int, tuple[int, int, int], tuple[float, float]]],
    policy: str,
    seed: int,
    num_output_tokens: int,
    session: tuple[int, int],
) -> None:
    workers = WORKERS[: len(cands)]
    index = _index([(blocks, cpu) for blocks, cpu, _, _, _ in cands])
    config = PolicyConfig(seed=seed)
    # The live shell's inputs: the index's matches, the predicted entries, the loads.
    live_policy = make_policy(policy, config)
    matches = asyncio.run(index.lookup(KEYS, workers)) if live_policy.uses_index else {}
    inputs = DecisionInputs(
        RouteRequest(KEYS, len(TOKENS), BS, num_output_tokens),
        workers,
        {w: WorkerLoad(*load) for w, (_, _, _, load, _) in zip(workers, cands, strict=True)},
        matches,
        {w: p for w, (_, _, p, _, _) in zip(workers, cands, strict=True) if p},
        {w: RecentWork(*recent) for w, (*_, recent) in zip(workers, cands, strict=True)},
        session_worker=WORKERS[session[0]] if session[0] < len(WORKERS) else None,
        session_bonus_tokens=session[1],
    )
    live = decide(live_policy, inputs)
    exp = asyncio.run(
        explain_request(
            index,
            TOKENS,
            workers,
            at_ts=2.0,
            policy=policy,
            config=config,  # a fresh policy, seeded the same
            block_size=BS,
            num_output_tokens=num_output_tokens,
            recorded=_logged(live, len(TOKENS)),
        )
    )
    assert exp.decision == live  # the pick, every score, every cost term, the weights
    if live.costs:  # the recent work came back from the log, not from a fresh record
        assert [c.recent_requests for c in exp.decision.costs] == [
            inputs.recent[w].requests for w in workers
        ]
    assert exp.costs == live.costs_by_worker()
    assert exp.agrees is True


# -- workers that differ from an idle one holding nothing are the only ones scored -----------

_busy = st.tuples(
    st.integers(0, 6),  # blocks it caches (GPU)
    st.integers(0, 6),  # blocks predicted entries credit it with
    st.sampled_from([WorkerLoad(), WorkerLoad(1, 0, 0), WorkerLoad(1, 50, 4)]),
    st.sampled_from([RecentWork(), RecentWork(1.0, 80.0), RecentWork(3.0, 10.0)]),
)


@settings(max_examples=150, deadline=None)
@given(
    num_workers=st.integers(1, 30),
    busy=st.dictionaries(st.integers(0, 29), _busy, max_size=6),
    policy=st.sampled_from(["cache_aware", "approximate"]),
    session=st.tuples(st.integers(0, 30), st.integers(0, 64)),  # worker (or none), bonus
    fair_share=st.sampled_from([0.0, 2048.0]),
)
def test_the_decision_equals_scoring_every_candidate_in_full(
    num_workers: int,
    busy: dict[int, tuple[int, int, WorkerLoad, RecentWork]],
    policy: str,
    session: tuple[int, int],
    fair_share: float,
) -> None:
    """The decider scores only workers that differ from an idle one holding nothing (all
    the others cost the same): the same decisions, ties rotated the same, as the policy
    scoring every candidate."""
    workers = [WorkerId(f"w{i:02d}") for i in range(num_workers)]
    busy = {i: b for i, b in busy.items() if i < num_workers}
    ids = {i: workers[i] for i in busy}
    inputs = DecisionInputs(
        RouteRequest(KEYS, len(TOKENS), BS, 4),
        workers,
        {ids[i]: load for i, (_, _, load, _) in busy.items()},
        {ids[i]: PrefixMatch(n, n, 0) for i, (n, _, _, _) in busy.items() if n},
        {ids[i]: p for i, (_, p, _, _) in busy.items() if p},
        {ids[i]: work for i, (*_, work) in busy.items()},
        session_worker=workers[session[0]] if session[0] < num_workers else None,
        session_bonus_tokens=session[1],
    )
    config = PolicyConfig(weights=CostWeights(fair_share=fair_share))
    sparse, full = make_policy(policy, config), make_policy(policy, config)
    candidates = with_session_bonus(
        build_candidates(workers, inputs.loads, inputs.matches, inputs.predicted, inputs.recent),
        inputs.session_worker,
        inputs.session_bonus_tokens,
    )
    for _ in range(4):  # successive decisions rotate among tied candidates
        assert decide(sparse, inputs) == full.decide(inputs.request, candidates)


# -- the simulator decides through the decider ----------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_simulators_decisions_are_the_deciders_on_the_same_inputs(policy: str) -> None:
    # Families of siblings over a shared first block, arriving faster than they prefill:
    # matches, predicted entries and loads all vary from one decision to the next.
    records = [rec(i * 40, [0, 1 + i % 5, 100 + i], out=8) for i in range(40)]
    config = SimConfig(num_workers=3, capacity_blocks=24, prefill_tokens_per_s=20_000.0)
    seen: list[tuple[DecisionInputs, Decision]] = []
    outcomes = asyncio.run(
        simulate(
            to_requests(records),
            make_policy(policy, config.policy),
            config,
            pool_cache_factory(),
            on_decision=lambda inputs, decision: seen.append((inputs, decision)),
        )
    )
    assert len(seen) == len(records)
    assert any(inputs.loads[w].num_requests for inputs, _ in seen for w in inputs.workers)
    fresh = make_policy(policy, config.policy)  # same settings, same seed, same rotation
    for inputs, decision in seen:
        assert decide(fresh, inputs) == decision
    chosen = [int(d.worker_id.removeprefix("sim-")) for _, d in seen]
    assert [o.worker for o in outcomes] == chosen  # arrival order is trace order here
    assert [o.predicted_tokens for o in outcomes] == [d.chosen.predicted_tokens for _, d in seen]
