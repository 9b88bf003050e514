"""Session affinity: the bounded session table, the bonus in the cost, and a real router."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from events.identity import WorkerId
from router.errors import RouterError
from router.load.model import WorkerLoad, routed
from router.routing.cost import CostWeights
from router.routing.policies import Candidate, PolicyConfig, RouteRequest, make_policy
from router.routing.sessions import SessionConfig, SessionTable, with_session_bonus
from tests.support.router_app import echo_workers, post, running_router

NO_SHARE = CostWeights(fair_share=0.0)
A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")


def test_table_remembers_the_last_worker_within_the_ttl() -> None:
    table = SessionTable(SessionConfig(ttl_s=10.0))
    table.record("s1", A, now=0.0)
    assert table.worker_of("s1", now=5.0) == A
    table.record("s1", B, now=6.0)  # served elsewhere since (failover, load)
    assert table.worker_of("s1", now=15.0) == B
    assert table.worker_of("s1", now=16.5) is None  # 10.5 s since its last request
    assert len(table) == 0
    assert table.worker_of("never", now=0.0) is None


def test_table_is_bounded_least_recently_seen_first() -> None:
    table = SessionTable(SessionConfig(max_entries=2))
    table.record("s1", A, now=0.0)
    table.record("s2", B, now=1.0)
    assert table.worker_of("s1", now=2.0) == A  # a lookup does not refresh: a record does
    table.record("s1", A, now=2.0)
    table.record("s3", C, now=3.0)  # s2 is the least recently seen
    assert [table.worker_of(k, now=3.0) for k in ("s1", "s2", "s3")] == [A, None, C]
    table.record("s4", C, now=1000.0)  # everything else expired on the way
    assert len(table) == 1


def test_forget_worker() -> None:
    table = SessionTable(SessionConfig())
    table.record("s1", A, now=0.0)
    table.record("s2", B, now=0.0)
    table.forget_worker(A)
    assert (table.worker_of("s1", 0.0), table.worker_of("s2", 0.0)) == (None, B)


@pytest.mark.parametrize("bad", [{"bonus_tokens": -1}, {"ttl_s": 0.0}, {"max_entries": 0}])
def test_config_is_checked(bad: dict[str, float]) -> None:
    with pytest.raises(RouterError):
        SessionConfig(**bad)  # type: ignore[arg-type]


def test_bonus_goes_to_the_sessions_worker_only() -> None:
    candidates = [Candidate(A), Candidate(B)]
    given = with_session_bonus(candidates, B, 16)
    assert [c.session_bonus_tokens for c in given] == [0, 16]
    assert with_session_bonus(candidates, C, 16) == candidates  # not a candidate now
    assert with_session_bonus(candidates, B, 0) == candidates  # affinity off


def test_bonus_wins_ties_and_loses_to_one_request_of_load() -> None:
    policy = make_policy("cache_aware")
    bonus = SessionConfig().bonus_tokens  # the default: worth half a request in flight
    request = RouteRequest(keys=[], num_prompt_tokens=100, block_size=16)
    for turn in range(4):  # whatever the tie-break turn
        decision = policy.decide(
            request, with_session_bonus([Candidate(A), Candidate(B)], B, bonus)
        )
        assert decision.worker_id == B, turn
    scores = {c.worker_id: c.score for c in decision.candidates}
    # The prefill weight times the bonus.
    assert scores[A] - scores[B] == CostWeights().prefill * bonus
    busy = [Candidate(A), Candidate(B, load=WorkerLoad(1, 0, 0))]
    assert policy.decide(request, with_session_bonus(busy, B, bonus)).worker_id == A
    # Policies that do not score costs ignore it.
    rr = make_policy("round_robin")
    pair = with_session_bonus([Candidate(A), Candidate(B)], B, bonus)
    picks = {rr.decide(request, pair).worker_id for _ in range(2)}
    assert picks == {A, B}


def prompt() -> str:
    """A prompt that shares no prefix with any other (nothing in the index helps)."""
    return uuid.uuid4().hex * 4


def test_router_keeps_a_session_on_its_worker_unless_it_is_overloaded(
    redis_url: str, namespace: str
) -> None:
    async def scenario() -> None:
        async with (
            echo_workers(2) as workers,
            # Fair share off: it is load too (recent work), and would move a session of
            # fresh prompts after a few requests (tests/router/test_share.py covers it).
            running_router(
                redis_url, namespace, workers, policy_config=PolicyConfig(weights=NO_SHARE)
            ) as (svc, client),
        ):

            async def complete(headers: dict[str, str] | None = None, **body: object) -> str:
                """The worker that served a fresh prompt (echo workers answer "ID:N")."""
                status, answer = await post(
                    client, "/v1/completions", {"prompt": prompt(), "max_tokens": 1, **body},
                    headers,
                )  # fmt: skip
                assert status == 200, answer
                return str(answer["choices"][0]["text"]).split(":")[0]

            # Without a session, equal loads and no shared prefix: ties rotate.
            assert {await complete(), await complete()} == {"w0", "w1"}
            session = {"X-Session-Id": "conversation-1"}
            first = await complete(session)
            for _ in range(3):
                assert await complete(session) == first
            # The body's user field is a session key too (the header wins over it).
            by_user = await complete(user="alice")
            assert await complete(user="alice") == by_user
            # Its worker overloaded: load says otherwise, and the session follows.
            svc.load.add_nowait(WorkerId(first), routed(4096, 0))
            moved = await complete(session)
            assert moved != first
            svc.load.add_nowait(WorkerId(first), WorkerLoad(-1, -4096, 0))
            assert await complete(session) == moved

    asyncio.run(scenario())
