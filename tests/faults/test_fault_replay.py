"""Replay faults into a real router: a replay endpoint that trickles malformed replies.

The worker a-bad meets a ``BlockStored`` with an unknown parent, so the router replays it
from seq 0; its replay endpoint is a ROUTER socket of the test that answers with a
malformed reply every 0.25 s, forever (each reply used to reset the replay's silence
timeout). The router is a real ``kvroute router`` process; both workers are
:class:`SyntheticWorker` (a real pool, publisher and worker HTTP in the test process).
Expectations: the healthy worker b-ok keeps its lease and its index stays exact while the
replay hangs, and the replay ends at its overall deadline with a resync of a-bad from its
snapshot (``kvroute index check``: 0 divergent entries for both).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import zmq

from events.schema import BlockStored, KVEventBatch
from tests.support.faults import (
    BLOCK_SIZE,
    HOST,
    Cluster,
    SyntheticWorker,
    handshake,
    index_check,
    metric,
    scrape,
    unique_prompts,
    wait_converged,
)

pytestmark = pytest.mark.slow

LEASE_TTL_S = 3.0
REPLAY_TIMEOUT_S = 1.0
REPLAY_DEADLINE_S = 8.0
TRICKLE_S = 0.25
"""Well under the replay timeout: the silence timeout alone never ends the replay."""
BOUND_S = 60.0
"""Start-up convergence and ``index check`` runs on a loaded 2-core machine."""


def trickle(sock: zmq.Socket[bytes], stop: threading.Event, requests: list[bytes]) -> None:
    """Answer every replay request with a malformed reply every ``TRICKLE_S``, forever."""
    peers: list[bytes] = []
    while not stop.is_set():
        if sock.poll(int(TRICKLE_S * 1000)):
            identity, *request = sock.recv_multipart()
            requests.append(b"".join(request))
            peers.append(identity)
        for peer in peers:
            sock.send_multipart([peer, b"not a replay reply"])


def orphan_batch() -> KVEventBatch:
    """One BlockStored whose parent the worker never stored."""
    return KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(
                block_hashes=[7_777_777],
                parent_block_hash=6_666_666,
                token_ids=list(range(BLOCK_SIZE)),
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
    )


def test_a_trickling_replay_endpoint_starves_no_lease_and_ends_at_its_deadline(
    tmp_path: Path,
) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    stop, requests = threading.Event(), []
    trickler = threading.Thread(target=trickle, args=(sock, stop, requests), daemon=True)
    prompts = unique_prompts(5)
    try:
        with (
            Cluster(tmp_path, num_workers=0) as cluster,
            SyntheticWorker("a-bad") as bad,
            SyntheticWorker("b-ok") as ok,
        ):
            router = cluster.start_router(
                "router",
                [bad.ports.spec(replay=f"tcp://{HOST}:{port}"), ok.ports.spec()],
                "--lease-ttl-s", str(LEASE_TTL_S),
                "--replay-timeout-s", str(REPLAY_TIMEOUT_S),
                "--replay-deadline-s", str(REPLAY_DEADLINE_S),
            )  # fmt: skip
            cluster.wait_healthy([router])
            handshake(cluster, router, bad, prompts)
            handshake(cluster, router, ok, prompts)
            targets = [("a-bad", bad.url), ("b-ok", ok.url)]
            wait_converged(cluster, targets, BOUND_S)
            trickler.start()
            assert bad.publisher.publish(orphan_batch())  # replay from 0: to the trickler
            deadline = time.monotonic() + BOUND_S
            while not requests:
                assert time.monotonic() < deadline, "no replay request came"
                time.sleep(0.05)  # polling another thread's list
            asked_at = time.monotonic()
            applied = metric(scrape(router), "kvroute_ingest_batches_total", worker="b-ok",
                             outcome="applied")  # fmt: skip
            num_steps = 0
            # Until past the replay's deadline: more than two lease TTLs.
            while time.monotonic() - asked_at < REPLAY_DEADLINE_S + 1:
                ok.step(next(prompts))
                num_steps += 1
                assert index_check(cluster, [("b-ok", ok.url)]) == {"b-ok": 0}
            took = wait_converged(cluster, targets, BOUND_S)
            samples = scrape(router)
            cluster.group.check_alive()
    finally:
        stop.set()
        if trickler.is_alive():
            trickler.join(30)
        context.destroy(linger=0)
    assert took < BOUND_S
    assert len(requests) == 1  # one replay, ended by its deadline
    assert metric(samples, "kvroute_ingest_leases_lost_total", worker="b-ok") == 0
    assert metric(samples, "kvroute_ingest_batches_total", worker="b-ok", outcome="applied") >= (
        applied + num_steps
    )
    assert (
        metric(samples, "kvroute_stream_resyncs_total", worker="a-bad", reason="replay_deadline")
        == 1
    )
    assert metric(samples, "kvroute_ingest_replays_total", worker="a-bad", outcome="failed") == 1
    assert metric(samples, "kvroute_stream_malformed_total", worker="a-bad") >= 1
