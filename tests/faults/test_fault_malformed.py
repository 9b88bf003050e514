"""Malformed messages on a worker's live stream into a real router: counted, never corrupting.

The test sends the live stream itself on a raw PUB socket: the batches of a
:class:`SyntheticWorker` (byte for byte what its publisher would send; the publisher only
keeps them for replay) mixed with randomly mutated messages: wrong frame counts, seq
frames of the wrong length, and undecodable payloads at a valid seq (whose seq the worker
then skips with an empty batch, so numbering stays continuous). Expectations: each
rejection is counted under its reason in ``/metrics``; an undecodable batch at a valid seq
resyncs the worker (its events are lost for good); and the index converges to the
worker's truth (``kvroute index check``: 0 divergent entries).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from events.framing import make_message
from events.schema import KVEventBatch, decode_batch, encode_batch
from tests.support.faults import (
    BLOCK_SIZE,
    HOST,
    Cluster,
    SyntheticWorker,
    index_check,
    metric,
    scrape,
    wait_converged,
)

pytestmark = pytest.mark.slow

BOUND_S = 60.0
"""Resyncs from the snapshot and ``index check`` runs on a loaded 2-core machine."""
NUM_STEPS = 60


class EverySeq:
    """Contains every seq: the worker's publisher sends nothing live, the test does."""

    def __contains__(self, seq: object) -> bool:
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 0


def skip_unknown(what: str) -> None:
    """Unknown event types are skipped one by one (and counted) by the subscriber."""


def garbage(rng: random.Random, valid: bytes) -> bytes:
    """A payload ``decode_batch`` rejects: random bytes or a mutated valid batch."""
    while True:
        if rng.random() < 0.5:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        else:
            mutable = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                mutable[rng.randrange(len(mutable))] = rng.randrange(256)
            data = bytes(mutable[: rng.randrange(1, len(mutable) + 1)])
        try:
            decode_batch(data, skip_unknown)  # as the subscriber decodes
        except ValueError:
            return data


def test_malformed_live_messages_are_counted_and_the_index_converges(tmp_path: Path) -> None:
    rng = random.Random(20261130)
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.linger = 0
    pub_port = pub.bind_to_random_port(f"tcp://{HOST}")
    expected: Counter[str] = Counter()
    num_undecodable = 0
    try:
        with (
            Cluster(tmp_path, num_workers=0) as cluster,
            SyntheticWorker("m0", skip_live_seqs=EverySeq()) as worker,
        ):
            ports = worker.ports
            spec = (
                f"m0={worker.url},events=tcp://{HOST}:{pub_port},"
                f"replay=tcp://{HOST}:{ports.replay},block-size={BLOCK_SIZE}"
            )
            router = cluster.start_router("router", [spec])
            cluster.wait_healthy([router])

            def step() -> None:
                prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 12) * BLOCK_SIZE)]
                seq = worker.step(prompt)
                if seq >= 0:
                    assert worker.last_batch is not None
                    pub.send_multipart(make_message(b"", seq, encode_batch(worker.last_batch)))

            # Handshake: valid batches until the router has received one.
            deadline = time.monotonic() + BOUND_S
            while metric(scrape(router), "kvroute_stream_batches_total", worker="m0") < 1:
                assert time.monotonic() < deadline, "the router never received a batch"
                step()
                time.sleep(0.1)  # polling another process's metrics
            wait_converged(cluster, [("m0", worker.url)], BOUND_S)
            for _ in range(NUM_STEPS):
                step()
                kind = rng.choice(["none", "none", "frames", "seq", "payload"])
                valid = encode_batch(worker.last_batch or KVEventBatch(ts=0.0, events=[]))
                if kind == "frames":
                    pub.send_multipart([b""] * rng.choice([1, 2, 4, 5]))
                    expected["bad_frames"] += 1
                elif kind == "seq":
                    seq_frame = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 7, 9])))
                    pub.send_multipart([b"", seq_frame, valid])
                    expected["bad_seq"] += 1
                elif kind == "payload":
                    bad = garbage(rng, valid)
                    try:
                        decode_batch(bad, skip_unknown)
                    except ValueError as exc:
                        expected[str(exc).split(":", 1)[0]] += 1
                    seq = worker.publisher.next_seq  # the worker skips it: an empty batch
                    worker.publisher.publish(KVEventBatch(ts=time.time(), events=[]))
                    pub.send_multipart(make_message(b"", seq, bad))
                    num_undecodable += 1
            step()  # a valid batch after the last message
            took = wait_converged(cluster, [("m0", worker.url)], BOUND_S)
            samples = scrape(router)
            assert index_check(cluster, [("m0", worker.url)]) == {"m0": 0}
            cluster.group.check_alive()
    finally:
        context.destroy(linger=0)
    assert took < BOUND_S
    counted = {
        reason: metric(samples, "kvroute_stream_malformed_total", worker="m0", reason=reason)
        for reason in expected
    }
    assert counted == dict(expected)
    assert metric(samples, "kvroute_stream_malformed_total", worker="m0") == sum(expected.values())
    resyncs = metric(
        samples, "kvroute_stream_resyncs_total", worker="m0", reason="undecodable_batch"
    )
    assert resyncs == num_undecodable
    assert num_undecodable >= 1 and expected["bad_frames"] >= 1 and expected["bad_seq"] >= 1
