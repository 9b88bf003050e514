"""``POST /v1/route`` lists the best few candidates by default, all or N on request."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from events.identity import WorkerId
from router.front.route_answer import DEFAULT_TOP_K
from router.front.service import RouterService
from router.load.model import WorkerLoad
from tests.support.router_app import post, run

NUM_WORKERS = 11
ROUTE = {"prompt": "r" * 64, "dry_run": True}


def _best_first(answer: dict[str, Any], count: int) -> list[str]:
    """Checks ``answer`` lists ``count`` candidates, the chosen one first, then by score;
    returns their worker ids."""
    listed = answer["candidates"]
    assert answer["num_candidates"] == NUM_WORKERS
    assert len(listed) == count
    assert listed[0]["worker_id"] == answer["worker_id"]
    assert [c["score"] for c in listed[1:]] == sorted(c["score"] for c in listed[1:])
    return [c["worker_id"] for c in listed]


def test_route_lists_the_best_few_by_default_and_all_or_n_on_request(
    redis_url: str, namespace: str
) -> None:
    async def scenario(svc: RouterService, client: aiohttp.ClientSession, _: Any) -> None:
        # w0 is busy: it ranks last, whatever the tie-breaks among the idle ones.
        svc.load.add_nowait(WorkerId("w0"), WorkerLoad(num_requests=3, decode_tokens=300))
        status, every = await post(client, "/v1/route?candidates=all", ROUTE)
        assert status == 200
        ids = _best_first(every, NUM_WORKERS)
        assert sorted(ids) == sorted(f"w{i}" for i in range(NUM_WORKERS))
        assert ids[-1] == "w0"
        _, default = await post(client, "/v1/route", ROUTE)
        assert "w0" not in _best_first(default, DEFAULT_TOP_K)
        _, three = await post(client, "/v1/route?top_k=3", ROUTE)
        _best_first(three, 3)
        _, two = await post(client, "/v1/route", {**ROUTE, "top_k": 2})
        _best_first(two, 2)
        _, many = await post(client, "/v1/route", {**ROUTE, "top_k": 1000})
        assert _best_first(many, NUM_WORKERS)[-1] == "w0"

    run(redis_url, namespace, scenario, n=NUM_WORKERS)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/route?top_k=0", ROUTE, "top_k must be a positive integer, got '0'"),
        ("/v1/route?top_k=x", ROUTE, "top_k must be a positive integer, got 'x'"),
        ("/v1/route", {**ROUTE, "top_k": 0}, "top_k must be a positive integer, got 0"),
        ("/v1/route?candidates=some", ROUTE, "candidates='some': the only value is 'all'"),
    ],
)
def test_a_bad_top_k_is_a_400(
    redis_url: str, namespace: str, path: str, body: dict[str, Any], message: str
) -> None:
    async def scenario(svc: RouterService, client: aiohttp.ClientSession, _: Any) -> None:
        status, answer = await post(client, path, body)
        assert status == 400
        assert message in answer["error"]["message"]

    run(redis_url, namespace, scenario)
