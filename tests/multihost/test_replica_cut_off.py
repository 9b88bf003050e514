"""A router replica's host cut off the network, under load through the other replica.

Two replicas share the workers by rendezvous hashing, each holding the leases of its
own. When one replica's link goes down it can no longer renew them in Redis: they lapse,
and the other replica takes its workers over (rebuilding them from their snapshots),
while its clients keep getting answers. When the link returns, the replica rejoins and
takes back its share, and the index stays exact throughout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from router.workers.leases import owner_of
from tests.support.faults import metric, scrape, wait_converged
from tests.support.multihost import MultiHostCluster
from tests.support.polling import wait_until

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

LEASE_TTL_S = 3.0
TAKEOVER_BOUND_S = 45.0
"""The cut replica's leases lapse (3 s), the other's maintenance takes them over and
rebuilds the workers from their snapshots; room for a loaded 2-core machine."""
REPLICA_IDS = {"r0": "r0", "r1": "r3"}
"""Router name -> replica id: each replica owns at least one of the three workers."""


def owned(cluster: MultiHostCluster, router: str) -> float:
    return metric(cluster.call(scrape, router), "kvroute_ingest_owned_workers")


def wait_owned(cluster: MultiHostCluster, router: str, count: int) -> float:
    return wait_until(
        lambda: owned(cluster, router) == count,
        f"{router} to hold {count} workers",
        timeout_s=TAKEOVER_BOUND_S,
    )


def test_the_other_replica_takes_over_a_cut_off_replicas_workers(tmp_path: Path) -> None:
    with MultiHostCluster(tmp_path) as cluster:
        workers = [(w.worker_id, w.url) for w in cluster.workers]
        ids = list(REPLICA_IDS.values())
        share = sum(owner_of(w, ids) == REPLICA_IDS["r1"] for w, _ in workers)
        assert 0 < share < len(workers)
        cluster.start_workers()
        specs = [w.spec() for w in cluster.workers]
        r0, r1 = (
            cluster.start_router(
                name, specs, "--lease-ttl-s", str(LEASE_TTL_S), "--replica-id", rid
            )
            for name, rid in REPLICA_IDS.items()
        )
        cluster.wait_healthy([r0, r1])
        wait_owned(cluster, r1, share)
        with cluster.load([r1]) as load:
            load.wait_for(10)
            cluster.hosts["r0"].link_down()
            try:
                took = wait_owned(cluster, r1, len(workers))
                load.wait_for(20)  # served from every worker meanwhile
                wait_converged(cluster, workers, TAKEOVER_BOUND_S)
            finally:
                cluster.hosts["r0"].link_up()
            rejoined = wait_owned(cluster, r1, share)  # r0 is back and takes its share
            load.wait_for(10)
            wait_converged(cluster, workers, TAKEOVER_BOUND_S)
        outcomes = load.stop()
        samples = cluster.call(scrape, r1)
        cluster.group.check_alive()
    assert set(outcomes) == {"200"}, dict(outcomes)
    assert took < TAKEOVER_BOUND_S and rejoined < TAKEOVER_BOUND_S
    taken = [w for w, _ in workers if owner_of(w, ids) == REPLICA_IDS["r0"]]
    for w in taken:
        assert metric(samples, "kvroute_ingest_snapshots_total", worker=w, outcome="ok") >= 1
