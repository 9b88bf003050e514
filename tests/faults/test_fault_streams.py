"""Event stream faults into a real router: PUB high-water-mark drops; silent and slow replay;
a restart whose first batches are lost (a seq jump, or a stream that looks continuous).

The worker is a :class:`SyntheticWorker` (a real pool and publisher in the test process,
with the worker's ``/health`` and ``/v1/snapshot``), so the test controls the publisher's
high-water mark and can lose batches on purpose; the router is a real ``kvroute router``
process. Expectations: the index converges to the worker's truth (``kvroute index check``
reports 0 divergent entries) within the stated bound, and every gap, replay and resync
shows in ``/metrics``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import zmq

from events.framing import unpack_seq
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
from tests.support.live_relay import EverySeq, LiveRelay

pytestmark = pytest.mark.slow

STALL_BOUND_S = 60.0
"""Replaying some thousands of batches and applying them, plus ``index check`` runs."""
REPLAY_TIMEOUT_S = 5.0
"""The subscriber's replay timeout (``SubscriberConfig.replay_timeout_s``)."""
SILENT_BOUND_S = REPLAY_TIMEOUT_S + 40.0
RESTART_BOUND_S = 10.0
"""A lifetime check, a reset, a replay from seq 0 and ``index check`` runs."""
BY_PROBE_ONLY = ("--lease-ttl-s", "600", "--event-idle-check-s", "0")
"""A maintenance pass every 200 s and no idle watchdog (which checks a reconnected stream's
lifetime too): only the subscriber's restart probe can see a restart."""


def test_stalled_consumer_makes_pub_drop_then_replay_converges(tmp_path: Path) -> None:
    prompts = unique_prompts(1)
    with (
        Cluster(tmp_path, num_workers=0) as cluster,
        SyntheticWorker("s0", hwm=8, buffer_steps=100_000) as worker,
    ):
        router = cluster.start_router("router", [worker.ports.spec()])
        cluster.wait_healthy([router])
        handshake(cluster, router, worker, prompts)
        targets = [("s0", worker.url)]
        wait_converged(cluster, targets, STALL_BOUND_S, poke=lambda: worker.step(next(prompts)))
        router_pid = cluster.group._procs["router"].pid
        os.kill(router_pid, signal.SIGSTOP)  # the consumer stalls: PUB hits its HWM
        try:
            num_stalled = 2_000  # far past what the socket buffers and HWM 8 hold
            worker.steps(next(prompts) for _ in range(num_stalled))
            # Every batch has left the publisher (sent to the socket or dropped at its HWM).
            deadline = time.monotonic() + 60
            while worker.publisher.num_published < worker.publisher.next_seq:
                assert time.monotonic() < deadline
                time.sleep(0.05)  # the publisher thread drains its queue
        finally:
            os.kill(router_pid, signal.SIGCONT)
        worker.step(next(prompts))  # a live batch after the drop reveals the gap
        took = wait_converged(
            cluster, targets, STALL_BOUND_S, poke=lambda: worker.step(next(prompts))
        )
        samples = scrape(router)
        assert index_check(cluster, targets) == {"s0": 0}
    assert took < STALL_BOUND_S
    assert worker.publisher.num_dropped == 0  # the drops were ZeroMQ's, after the queue
    missed = metric(samples, "kvroute_stream_missed_batches_total", worker="s0")
    assert metric(samples, "kvroute_stream_gaps_total", worker="s0") >= 1
    assert 1 <= missed <= num_stalled
    assert metric(samples, "kvroute_stream_replays_total", worker="s0") >= 1
    assert metric(samples, "kvroute_stream_resyncs_total", worker="s0") == 0
    # Every seq from the stall on reached the sink once: live, or replayed after its gap.
    assert metric(samples, "kvroute_stream_replayed_batches_total", worker="s0") >= missed


def test_silent_replay_endpoint_times_out_and_resyncs_from_the_snapshot(tmp_path: Path) -> None:
    prompts = unique_prompts(2)
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # accepts replay requests, never answers
    silent.linger = 0
    silent_port = silent.bind_to_random_port(f"tcp://{HOST}")
    skip: set[int] = set()
    try:
        with (
            Cluster(tmp_path, num_workers=0) as cluster,
            SyntheticWorker("s1", skip_live_seqs=skip) as worker,
        ):
            spec = worker.ports.spec(replay=f"tcp://{HOST}:{silent_port}")
            router = cluster.start_router("router", [spec])
            cluster.wait_healthy([router])
            handshake(cluster, router, worker, prompts)
            targets = [("s1", worker.url)]
            wait_converged(
                cluster, targets, SILENT_BOUND_S, poke=lambda: worker.step(next(prompts))
            )
            lost = worker.publisher.next_seq
            skip.add(lost)  # this batch never goes out live; only replay could bring it
            assert worker.step(next(prompts)) == lost
            worker.step(next(prompts))  # the gap shows
            assert silent.poll(int(SILENT_BOUND_S * 1000)), "no replay request came"
            identity, empty, seq = silent.recv_multipart()
            assert (empty, unpack_seq(seq)) == (b"", lost)
            took = wait_converged(cluster, targets, SILENT_BOUND_S)
            samples = scrape(router)
            assert not silent.poll(0), "a second replay was requested"
            del identity
    finally:
        context.destroy(linger=0)
    assert took < SILENT_BOUND_S
    assert metric(samples, "kvroute_stream_gaps_total", worker="s1") == 1
    assert metric(samples, "kvroute_stream_missed_batches_total", worker="s1") == 1
    assert (
        metric(samples, "kvroute_stream_resyncs_total", worker="s1", reason="replay_timeout") == 1
    )
    assert (
        metric(samples, "kvroute_ingest_resyncs_total", worker="s1", reason="replay_timeout") == 1
    )
    assert metric(samples, "kvroute_ingest_snapshots_total", worker="s1", outcome="ok") == 2


SLOW_DELAY_S = 2.0
"""How long the slow endpoint holds each replay before answering (under the timeout)."""


def slow_relay(
    context: zmq.Context[zmq.Socket[bytes]], upstream: str, stop: threading.Event
) -> tuple[int, threading.Thread]:
    """A replay endpoint that forwards to ``upstream`` and answers ``SLOW_DELAY_S`` late.

    Returns:
        The port it listens on and the thread serving it until ``stop`` is set (join it
        before destroying ``context``).
    """
    front = context.socket(zmq.ROUTER)
    front.linger = 0
    port = front.bind_to_random_port(f"tcp://{HOST}")

    def serve() -> None:
        back = context.socket(zmq.DEALER)
        back.linger = 0
        back.connect(upstream)
        try:
            while not stop.is_set():
                if not front.poll(50):
                    continue
                identity, *request = front.recv_multipart()
                back.send_multipart(request)
                replies = []
                while True:  # collect the whole replay, end marker included
                    assert back.poll(30_000), "the real replay endpoint did not answer"
                    reply = back.recv_multipart()
                    replies.append(reply)
                    if reply[1] == b"" and reply[3] == b"":
                        break
                stop.wait(SLOW_DELAY_S)
                for reply in replies:
                    front.send_multipart([identity, *reply])
        finally:
            back.close()
            front.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


def test_slow_replay_endpoint_still_closes_the_gap(tmp_path: Path) -> None:
    prompts = unique_prompts(3)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    stop = threading.Event()
    skip: set[int] = set()
    try:
        with (
            Cluster(tmp_path, num_workers=0) as cluster,
            SyntheticWorker("s2", skip_live_seqs=skip) as worker,
        ):
            upstream = f"tcp://{HOST}:{worker.ports.replay}"
            relay, relay_thread = slow_relay(context, upstream, stop)
            router = cluster.start_router(
                "router", [worker.ports.spec(replay=f"tcp://{HOST}:{relay}")]
            )
            cluster.wait_healthy([router])
            handshake(cluster, router, worker, prompts)
            targets = [("s2", worker.url)]
            wait_converged(
                cluster, targets, SILENT_BOUND_S, poke=lambda: worker.step(next(prompts))
            )
            lost = worker.publisher.next_seq
            skip.add(lost)
            assert worker.step(next(prompts)) == lost
            worker.step(next(prompts))  # the gap shows; the replay answers 2 s late
            took = wait_converged(cluster, targets, SILENT_BOUND_S)
            samples = scrape(router)
            stop.set()
            relay_thread.join(30)
    finally:
        stop.set()
        context.destroy(linger=0)
    assert took < SILENT_BOUND_S
    assert metric(samples, "kvroute_stream_gaps_total", worker="s2") == 1
    assert metric(samples, "kvroute_stream_missed_batches_total", worker="s2") == 1
    assert metric(samples, "kvroute_stream_replays_total", worker="s2") == 1
    # The replay brings the lost batch and the one that revealed the gap (held back live).
    assert metric(samples, "kvroute_stream_replayed_batches_total", worker="s2") == 2
    assert metric(samples, "kvroute_stream_resyncs_total", worker="s2") == 0
    assert metric(samples, "kvroute_ingest_replays_total", worker="s2", outcome="failed") == 0


def test_restart_whose_first_batches_are_lost_is_still_a_reset(tmp_path: Path) -> None:
    """A worker restarted in place whose first new batches never reach the router.

    Its old lifetime ended below seq 4; the new one's first 20 batches are lost on the way
    (slow joiner after the reconnect, or drops), so the first seq the router sees is *above*
    the old last seq: a jump, not a drop. The router asks the worker's ``/health`` for its
    lifetime id before replaying the jump as a gap, sees a new one and resets the worker.
    """
    prompts = unique_prompts(4)
    with Cluster(tmp_path, num_workers=0) as cluster:
        old = SyntheticWorker("s3")
        try:
            router = cluster.start_router("router", [old.ports.spec()], *BY_PROBE_ONLY)
            cluster.wait_healthy([router])
            handshake(cluster, router, old, prompts)
            targets = [("s3", old.url)]
            wait_converged(cluster, targets, SILENT_BOUND_S)
            assert old.publisher.next_seq <= 4, "the old lifetime must end below seq 4"
            ports = old.ports
        finally:
            old.close()
        seen = metric(scrape(router), "kvroute_stream_batches_total", worker="s3")
        with SyntheticWorker("s3", ports=ports, skip_live_seqs=set(range(20))) as new:
            deadline = time.monotonic() + SILENT_BOUND_S
            while metric(scrape(router), "kvroute_stream_batches_total", worker="s3") <= seen:
                assert time.monotonic() < deadline, "the router never saw the new lifetime"
                new.step(next(prompts))  # seqs 0..19 stay in the replay buffer only
                time.sleep(0.05)  # polling another process's metrics
            took = wait_converged(cluster, [("s3", new.url)], RESTART_BOUND_S)
            samples = scrape(router)
    assert took < RESTART_BOUND_S
    # One restart, seen by the lifetime check (no seq drop); the lost 0..19 replayed.
    assert metric(samples, "kvroute_stream_resets_total", worker="s3") == 1
    assert metric(samples, "kvroute_ingest_resets_total", worker="s3") == 1
    assert metric(samples, "kvroute_stream_gaps_total", worker="s3") == 1
    assert metric(samples, "kvroute_stream_resyncs_total", worker="s3") == 0


LIFETIME_STEPS = 12
"""Batches of the old lifetime (seqs 0..11), and of the new one lost on the way."""


def test_restart_whose_lost_batches_make_the_stream_look_continuous_is_a_reset(
    tmp_path: Path,
) -> None:
    """The old lifetime ended at seq 11; the new one's 0..11 are lost (the router does not
    get them while the worker restarts and serves 12 batches), so the first it sees is
    seq 12: the next seq, no jump. The connection dropped, so the router asks the worker
    for its lifetime id before taking that batch, sees a new one, resets the worker and
    replays the new lifetime from seq 0.

    The live stream goes through the test's :class:`LiveRelay` on the worker's events
    address (restarted with it), so exactly seqs 0..11 of the new lifetime are lost.
    """
    prompts = unique_prompts(6)
    with Cluster(tmp_path, num_workers=0) as cluster, LiveRelay() as relay:
        old = SyntheticWorker("s4", skip_live_seqs=EverySeq())
        try:
            ports = old.ports
            spec = (
                f"s4={old.url},events={relay.address},replay=tcp://{HOST}:{ports.replay},"
                f"block-size={BLOCK_SIZE}"
            )
            router = cluster.start_router("router", [spec], *BY_PROBE_ONLY)
            cluster.wait_healthy([router])
            relay.wait_subscribed()
            for _ in range(LIFETIME_STEPS):
                seq = old.step(next(prompts))
                relay.send(seq, old.last_batch)
            assert seq == LIFETIME_STEPS - 1
            wait_converged(cluster, [("s4", old.url)], SILENT_BOUND_S)
            applied = metric(scrape(router), "kvroute_ingest_batches_total", worker="s4",
                             outcome="applied")  # fmt: skip
        finally:
            old.close()
        relay.restart()
        with SyntheticWorker("s4", ports=ports, skip_live_seqs=EverySeq()) as new:
            for _ in range(LIFETIME_STEPS):
                new.step(next(prompts))  # seqs 0..11: lost, kept for replay
            relay.wait_subscribed()  # the router is connected again
            seq = new.step(next(prompts))
            assert seq == LIFETIME_STEPS
            relay.send(seq, new.last_batch)
            took = wait_converged(cluster, [("s4", new.url)], RESTART_BOUND_S)
            samples = scrape(router)
    assert took < RESTART_BOUND_S
    assert applied >= LIFETIME_STEPS
    assert metric(samples, "kvroute_stream_resets_total", worker="s4") == 1
    assert metric(samples, "kvroute_ingest_resets_total", worker="s4") == 1
    assert metric(samples, "kvroute_stream_gaps_total", worker="s4") == 1  # 0..11 replayed
    assert metric(samples, "kvroute_stream_replayed_batches_total", worker="s4") == (
        LIFETIME_STEPS + 1
    )
    assert metric(samples, "kvroute_stream_resyncs_total", worker="s4") == 0
