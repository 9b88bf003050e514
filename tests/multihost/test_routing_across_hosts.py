"""Routing and cache hits across hosts: Redis, two router replicas and three workers, each
in its own network namespace, reached only by their addresses on the bridge.

A prompt sent through one replica is served again, from the cache, through the other:
the replicas share one index in Redis over the network, and every worker's events reach
both replicas from its own host. The index then equals the workers' caches exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.faults import complete, family_prompts, get_json, wait_converged
from tests.support.multihost import MultiHostCluster

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

CONVERGE_BOUND_S = 60.0
"""Every batch of a few dozen requests in Redis, on a loaded 2-core machine."""
MIN_CACHED_TOKENS = 16
"""A repeated 24-token prompt (4-token blocks) hits its cached blocks (the last one's
final token is always recomputed, so 20 at most)."""


def test_replicas_route_to_cached_workers_across_hosts(tmp_path: Path) -> None:
    with MultiHostCluster(tmp_path) as cluster:
        cluster.start_workers()
        specs = [w.spec() for w in cluster.workers]
        routers = [cluster.start_router(name, specs) for name in ("r0", "r1")]
        cluster.wait_healthy(routers)
        addresses = {cluster.address(n) for n in ("redis", "r0", "r1", "w0", "w1", "w2")}
        assert len(addresses) == 6, "every process on a host of its own"
        prompts = family_prompts(7, 12)
        for prompt in prompts:
            cluster.call(complete, routers[0], prompt)
        workers = [(w.worker_id, w.url) for w in cluster.workers]
        wait_converged(cluster, workers, CONVERGE_BOUND_S)
        again = [cluster.call(complete, routers[1], prompt) for prompt in prompts]
        status, listed = cluster.call(get_json, f"{routers[1]}/v1/workers")
        wait_converged(cluster, workers, CONVERGE_BOUND_S)
    cached = [answer["usage"]["cached_tokens"] for answer in again]
    assert min(cached) >= MIN_CACHED_TOKENS, cached
    assert status == 200
    rows = listed["workers"] if isinstance(listed, dict) else listed
    urls = {row["worker_id"]: row["url"] for row in rows}
    assert urls == {w.worker_id: w.url for w in cluster.workers}
    assert not any(u.startswith("http://127.") for u in urls.values())
