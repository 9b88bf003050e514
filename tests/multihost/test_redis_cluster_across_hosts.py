"""The index on a Redis Cluster whose three masters are on three hosts, with a router and
two workers on hosts of their own: the router follows the cluster's slots to each master
by its address on the bridge, cached prefixes are routed to, and the index equals the
workers' caches exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.support.faults import complete, family_prompts, wait_converged
from tests.support.multihost import MultiHostCluster

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

CONVERGE_BOUND_S = 60.0
"""A few dozen requests' batches written across three masters, on a loaded machine."""
MIN_CACHED_TOKENS = 16
"""A repeated 24-token prompt hits at least 4 of its 4-token blocks."""


def num_keys(host: str, port: int) -> int:
    with redis.Redis(host=host, port=port) as client:
        return int(client.dbsize())


def test_the_index_on_a_redis_cluster_across_hosts(tmp_path: Path) -> None:
    with MultiHostCluster(tmp_path, num_workers=2, redis_masters=3) as cluster:
        cluster.start_workers()
        router = cluster.start_router("r0", [w.spec() for w in cluster.workers])
        cluster.wait_healthy([router])
        masters = [cluster.address(n) for n in ("redis", "redis1", "redis2")]
        prompts = family_prompts(11, 16)
        for prompt in prompts:
            cluster.call(complete, router, prompt)
        workers = [(w.worker_id, w.url) for w in cluster.workers]
        wait_converged(cluster, workers, CONVERGE_BOUND_S)
        again = [cluster.call(complete, router, prompt) for prompt in prompts]
        took = wait_converged(cluster, workers, CONVERGE_BOUND_S)
        keys = [cluster.call(num_keys, master, cluster.redis_port) for master in masters]
    assert len(set(masters)) == 3
    assert min(keys) > 0, keys  # the index is spread over the three hosts' masters
    cached = [answer["usage"]["cached_tokens"] for answer in again]
    assert min(cached) >= MIN_CACHED_TOKENS, cached
    assert took < CONVERGE_BOUND_S
