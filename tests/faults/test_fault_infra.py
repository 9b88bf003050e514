"""Infrastructure faults under load: Redis restarted empty; a router replica SIGKILLed.

Real processes on loopback. Expectations after each fault: ``kvroute index check``
reports 0 divergent entries within the stated bound, no request is lost (an answer, a
JSON error, or, for the killed replica's own clients, a connection error), and the fault
shows in ``/metrics``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Final

import pytest

from router.workers.leases import owner_of
from tests.support.faults import (
    Cluster,
    Load,
    get_json,
    metric,
    scrape,
    wait_converged,
)
from tests.support.polling import wait_until

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

LEASE_TTL_S = 3.0
REDIS_BOUND_S = 45.0
"""Redis back -> every worker rebuilt from its snapshot: a maintenance pass (a third of
the lease) per worker plus ``index check`` runs, with room for a loaded 2-core machine."""
QUIET_BOUND_S = 15.0
"""Load stopped -> the events of its last requests are ingested (a group-commit flush)."""
REPLICA_BOUND_S = 45.0
"""The dead replica's leases lapse (3 s), the survivor's maintenance takes them over and
rebuilds the workers from their snapshots."""


def wait_owned(router: str, count: int, bound_s: float = REPLICA_BOUND_S) -> None:
    """Poll a router's metrics until it holds the leases of ``count`` workers."""
    wait_until(
        lambda: metric(scrape(router), "kvroute_ingest_owned_workers") == count,
        f"{router} to hold {count} workers",
        timeout_s=bound_s,
    )


def wait_health(router: str, index: str, timeout_s: float = 60.0) -> None:
    last: list[Any] = []

    def says() -> bool:
        status, body = get_json(f"{router}/health")
        last[:] = [body]
        return status == 200 and body.get("index") == index

    wait_until(says, lambda: f"/health to say index={index}: {last}", timeout_s=timeout_s)


def test_redis_stopped_and_restarted_empty(tmp_path: Path) -> None:
    with Cluster(tmp_path) as cluster:
        cluster.start_workers()
        router = cluster.start_router(
            "router", [w.spec() for w in cluster.workers], "--lease-ttl-s", str(LEASE_TTL_S)
        )
        cluster.wait_healthy([*(w.url for w in cluster.workers), router])
        targets = [(w.worker_id, w.url) for w in cluster.workers]
        with Load([router], clients=3) as load:
            load.wait_for(15)
            cluster.stop_redis()
            load.wait_for(15)  # served on load alone while Redis is down
            wait_health(router, "degraded")
            outage = scrape(router)
            cluster.start_redis()  # empty: no registrations, no leases, no entries
            wait_health(router, "live")
            load.wait_for(10)
            took = wait_converged(cluster, targets, REDIS_BOUND_S)
        outcomes = load.stop()
        # The last requests' events may still be on their way: exact once they land.
        wait_converged(cluster, targets, QUIET_BOUND_S)
        samples = scrape(router)
        cluster.group.check_alive()
    assert set(outcomes) == {"200"}, dict(outcomes)
    assert took < REDIS_BOUND_S
    assert metric(outage, "kvroute_router_index_live") == 0
    assert metric(samples, "kvroute_router_index_live") == 1
    assert metric(samples, "kvroute_router_index_errors_total") >= 1
    assert metric(samples, "kvroute_index_data_losses_total") >= 1  # the markers were gone
    for w in ("w0", "w1"):
        # Each worker's entries came back: rebuilt from its snapshot (one that lost batches
        # while Redis was down), or written again from what the router held of it (one
        # that lost none: no request went to it during the outage).
        rebuilt = metric(samples, "kvroute_ingest_snapshots_total", worker=w, outcome="ok") >= 2
        restored = metric(samples, "kvroute_ingest_restores_total", worker=w) >= 1
        assert rebuilt or restored, w


REPLICA_IDS: Final = {"r0": "r0", "r1": "r3"}
"""Router name -> replica id, chosen so that each replica owns one worker (rendezvous)."""


def start_replica(cluster: Cluster, name: str, *also_healthy: str) -> str:
    """Start router ``name`` over every worker, under its replica id; wait until it (and
    ``also_healthy``) answer. Returns its URL."""
    url = cluster.start_router(
        name,
        [w.spec() for w in cluster.workers],
        "--lease-ttl-s", str(LEASE_TTL_S),
        "--replica-id", REPLICA_IDS[name],
    )  # fmt: skip
    cluster.wait_healthy([*also_healthy, url])
    return url


def test_router_replica_killed_with_in_flight_load(tmp_path: Path) -> None:
    assert {w: owner_of(w, list(REPLICA_IDS.values())) for w in ("w0", "w1")} == {
        "w0": "r0",
        "w1": "r3",
    }
    with Cluster(tmp_path) as cluster:
        cluster.start_workers()
        r0 = start_replica(cluster, "r0", *(w.url for w in cluster.workers))
        assert metric(scrape(r0), "kvroute_ingest_owned_workers") == 2  # alone, it owns both
        r1 = start_replica(cluster, "r1")
        targets = [(w.worker_id, w.url) for w in cluster.workers]
        with Load([r0, r1], clients=4) as load:
            load.wait_for(20)
            wait_owned(r1, 1)  # r0 hands w1 over
            cluster.kill("r0")
            killed_at = time.monotonic()
            load.wait_for(30)  # r1 keeps answering
            wait_owned(r1, 2)  # r1 takes over
            load.wait_for(10)  # the workers' caches moved on since r0 died
            wait_converged(cluster, targets, REPLICA_BOUND_S)
            took = time.monotonic() - killed_at
        outcomes = load.stop()
        samples = scrape(r1)
        cluster.group.check_alive()
    assert took < REPLICA_BOUND_S
    # r0's clients got connection errors (in flight or refused), never a hang or a bad answer.
    assert set(outcomes) <= {"200", "connection"}, dict(outcomes)
    assert outcomes["connection"] >= 1
    assert metric(samples, "kvroute_ingest_owned_workers") == 2
    # w1 came over with r0's state of it (entries kept); w0, which r0 held when it was
    # killed, was rebuilt from its snapshot.
    assert metric(samples, "kvroute_ingest_handoffs_total", worker="w1", outcome="resumed") == 1
    assert metric(samples, "kvroute_ingest_snapshots_total", worker="w0", outcome="ok") >= 1


def test_rolling_restart_of_a_router_replica_keeps_every_entry(tmp_path: Path) -> None:
    """A replica stopped (SIGTERM) and started again, under load: its worker goes to the
    other replica with its state of it and comes back the same way. No worker is rebuilt
    (no snapshot is fetched after the first), and the index stays exact."""
    with Cluster(tmp_path) as cluster:
        cluster.start_workers()
        r0 = start_replica(cluster, "r0", *(w.url for w in cluster.workers))
        r1 = start_replica(cluster, "r1")
        wait_owned(r1, 1)  # r0 handed w1 over
        targets = [(w.worker_id, w.url) for w in cluster.workers]
        with Load([r1], clients=2) as load:
            load.wait_for(10)
            cluster.group.stop(["r0"])  # graceful: w0 goes to r1 with r0's state of it
            wait_owned(r1, 2)
            load.wait_for(10)
            r0 = start_replica(cluster, "r0")
            wait_owned(r0, 1)  # r1 hands w0 back
            load.wait_for(10)
            wait_converged(cluster, targets, REPLICA_BOUND_S)
        assert set(load.stop()) == {"200"}
        back, stayed = scrape(r0), scrape(r1)
        cluster.group.check_alive()
    for w in ("w0", "w1"):
        assert metric(stayed, "kvroute_ingest_handoffs_total", worker=w, outcome="resumed") == 1
        assert metric(stayed, "kvroute_ingest_snapshots_total", worker=w, outcome="ok") == 0
    assert metric(back, "kvroute_ingest_handoffs_total", worker="w0", outcome="resumed") == 1
    assert metric(back, "kvroute_ingest_snapshots_total", worker="w0", outcome="ok") == 0
