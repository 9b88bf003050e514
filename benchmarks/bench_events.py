"""Benchmark: KV block events/s from EventPublisher to EventSubscriber over tcp loopback.

Two processes, one core each as far as the OS allows: a sender child (``--sender``) and the
receiver (this process). For batches of 1 and 32 blocks (one ``BlockStored`` each, 16
tokens per block) it times four pairings in the same run:

* raw PUB -> raw SUB: pyzmq alone, sending the very payload bytes kvroute would send and
  receiving them without decoding (the baseline);
* EventPublisher -> EventSubscriber: the full path (encode, ring buffer, send; receive,
  seq tracking, decode, sink call);
* EventPublisher -> raw SUB and raw PUB -> EventSubscriber: each side alone, to show
  which side limits the full path.

The receiver's clock starts when the sender announces its first measured seq and stops
when the last one is delivered. High-water marks are unlimited, so nothing is dropped.
Each figure is the median over repeats of block events/s; ratio = figure / raw baseline.
Beside it, the CPU time the receiving process spent per batch (median over repeats).

A second table gives the CPU cost per message of each step either side pays (pyzmq's
multipart calls beside :func:`events.framing.send_frames` / ``recv_frames``, encode,
decode: ``decode_batch`` as it runs, in C where ``events._wire`` was built, beside its
Python spec ``python_decode_batch``), timed in one process over inproc PUB/SUB (no I/O
thread involved).

Run: ``python -m benchmarks.bench_events`` (``--quick`` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import IO, Final

import zmq

from benchmarks.environment import describe, native_text
from events.endpoints import Endpoint
from events.framing import pack_seq, recv_frames, send_frames, unpack_seq
from events.publisher import EventPublisher, PublisherConfig
from events.schema import (
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    python_decode_batch,
)
from events.subscriber import EventSubscriber, ReceivedBatch, SubscriberConfig, WorkerStream

__all__ = ["main"]

BLOCK_SIZE: Final = 16
TIMEOUT_S: Final = 120.0
TARGET_EVENTS_PER_S: Final = 100_000
TARGET_RATIO: Final = 0.5
STEP_CHUNK: Final = 1_000


def make_batch(n: int, num_blocks: int) -> KVEventBatch:
    """A batch of one ``BlockStored`` of ``num_blocks`` 16-token blocks."""
    return KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(
                block_hashes=[
                    (n * num_blocks + i) * 0x9E3779B97F4A7C15 % 2**64 for i in range(num_blocks)
                ],
                parent_block_hash=None if n % 4 == 0 else n * 7919,
                token_ids=list(range(n, n + num_blocks * BLOCK_SIZE)),
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
        data_parallel_rank=0,
    )


# --- sender child ---------------------------------------------------------------------


def _wait_for_line(stream: IO[str], idle: Callable[[], object]) -> str:
    """Read a line from ``stream``, calling ``idle()`` (send a probe) every 10 ms meanwhile."""
    while not select.select([stream], [], [], 0.01)[0]:
        idle()
    return stream.readline()


def run_sender(kind: str, num_blocks: int, count: int) -> int:
    """Publish ``count`` batches when told to; the protocol runs over stdin/stdout."""
    batches = [make_batch(i, num_blocks) for i in range(count)]
    probe = make_batch(0, 1)
    if kind == "kvroute":
        pub = EventPublisher(
            PublisherConfig(
                endpoint=Endpoint.binding("tcp://127.0.0.1:*"),
                replay_endpoint=Endpoint.binding("tcp://127.0.0.1:*"),
                max_queue_size=count + 10_000,
                hwm=0,
                linger_ms=0,
            )
        )
        print(pub.address, pub.replay_address, flush=True)
        _wait_for_line(sys.stdin, lambda: pub.publish(probe))
        print(f"start {pub.next_seq}", flush=True)
        publish = pub.publish
        for batch in batches:
            publish(batch)
        sys.stdin.readline()
        pub.close()
        return 0
    payloads = [encode_batch(b) for b in batches]
    probe_payload = encode_batch(probe)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.sndhwm = 0
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", "-", flush=True)
    seq = 0

    def send_probe() -> None:
        nonlocal seq
        sock.send_multipart([b"", pack_seq(seq), probe_payload])
        seq += 1

    _wait_for_line(sys.stdin, send_probe)
    print(f"start {seq}", flush=True)
    send = sock.send_multipart
    for payload in payloads:
        send([b"", pack_seq(seq), payload])
        seq += 1
    sys.stdin.readline()
    sock.close()
    ctx.term()
    return 0


# --- receiver -------------------------------------------------------------------------


class _Sender:
    """The sender child process and its control pipe."""

    def __init__(self, kind: str, num_blocks: int, count: int) -> None:
        self.count = count
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_events",
                "--sender",
                kind,
                "--blocks",
                str(num_blocks),
                "--count",
                str(count),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        address, replay = self.stdout.readline().split()
        self.address, self.replay = address, (None if replay == "-" else replay)

    def go(self) -> tuple[int, float]:
        """Start the measured run; returns its first seq and the start time."""
        self.stdin.write("go\n")
        self.stdin.flush()
        start = int(self.stdout.readline().split()[1])
        return start, time.perf_counter()

    def finish(self) -> None:
        self.stdin.write("exit\n")
        self.stdin.flush()
        self.proc.wait(TIMEOUT_S)


def receive_raw(sender: _Sender, *, decode: bool = False) -> float:
    """Seconds a raw SUB takes to receive the measured batches (decoding each if asked)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.rcvhwm = 0
    sock.linger = 0
    sock.rcvtimeo = int(TIMEOUT_S * 1000)
    sock.subscribe(b"")
    sock.connect(sender.address)
    try:
        sock.recv_multipart()  # a probe: subscribed
        first, began = sender.go()
        last = first + sender.count - 1
        recv = sock.recv_multipart
        if decode:
            while True:
                frames = recv()
                decode_batch(frames[2])
                if unpack_seq(frames[1]) >= last:
                    break
        else:
            while unpack_seq(recv()[1]) < last:
                pass
        return time.perf_counter() - began
    finally:
        sock.close()
        ctx.term()


class _CountingSink:
    def __init__(self) -> None:
        self.last_seq = -1
        self.target: int | None = None
        self.seen = asyncio.Event()
        self.done = asyncio.Event()

    async def on_batch(self, received: ReceivedBatch) -> None:
        self.seen.set()
        if self.target is not None and received.seq >= self.target:
            self.done.set()

    async def on_reset(self, worker_id: str, seq: int) -> None:
        raise AssertionError(f"unexpected reset at seq {seq}")

    async def on_resync_needed(self, worker_id: str, reason: str) -> None:
        raise AssertionError(f"unexpected resync: {reason}")


def receive_subscriber(sender: _Sender) -> float:
    """Seconds an EventSubscriber takes to deliver the measured batches to a sink."""

    async def run() -> float:
        sink = _CountingSink()
        async with EventSubscriber(sink, SubscriberConfig(hwm=0)) as sub:
            await sub.add_worker(WorkerStream("w0", sender.address, sender.replay))
            await asyncio.wait_for(sink.seen.wait(), TIMEOUT_S)
            first, began = sender.go()
            sink.target = first + sender.count - 1
            await asyncio.wait_for(sink.done.wait(), TIMEOUT_S)
            elapsed = time.perf_counter() - began
            counters = sub.counters("w0")
            assert counters.num_gaps == 0 and not counters.malformed, counters
            return elapsed

    return asyncio.run(run())


@dataclass(frozen=True)
class Pairing:
    """A benchmark row: who sends, who receives."""

    label: str
    sender: str  # "raw" or "kvroute"
    receive: Callable[[_Sender], float]


PAIRINGS: Final = (
    Pairing("raw PUB -> raw SUB", "raw", receive_raw),
    Pairing("raw PUB -> raw SUB + decode_batch", "raw", partial(receive_raw, decode=True)),
    Pairing("EventPublisher -> EventSubscriber", "kvroute", receive_subscriber),
    Pairing("EventPublisher -> raw SUB", "kvroute", receive_raw),
    Pairing("raw PUB -> EventSubscriber", "raw", receive_subscriber),
)
BASELINE: Final = PAIRINGS[0]
TARGET_ROW: Final = PAIRINGS[2]


@dataclass(frozen=True)
class Sample:
    """One run of a pairing.

    Attributes:
        rate: Block events/s.
        receiver_cpu_us: CPU the receiving process spent per batch (all its threads,
            libzmq's I/O thread included), in µs: what the receiver costs, which a busy
            box inflates less than it slows the rate.
    """

    rate: float
    receiver_cpu_us: float


def measure(pairing: Pairing, num_blocks: int, count: int) -> Sample:
    """One run of ``pairing``."""
    sender = _Sender(pairing.sender, num_blocks, count)
    try:
        began = time.process_time()
        elapsed = pairing.receive(sender)
        cpu_s = time.process_time() - began
        sender.finish()
    finally:
        sender.proc.kill()
    return Sample(count * num_blocks / elapsed, cpu_s / count * 1e6)


def measure_steps(num_blocks: int, count: int) -> dict[str, float]:
    """µs per message of each send/receive step over inproc in this process.

    Messages go in chunks of :data:`STEP_CHUNK` (a receive step finds a chunk queued, a
    send step's chunk is received untimed after it); best of 5 passes of ``count``.
    """
    batch = make_batch(0, num_blocks)
    payload = encode_batch(batch)
    chunk = [(b"", pack_seq(seq), payload) for seq in range(STEP_CHUNK)]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    pub.sndhwm = sub.rcvhwm = 0
    sub.subscribe(b"")
    pub.bind("inproc://steps")
    sub.connect("inproc://steps")

    def timed(
        step: Callable[[], object],
        before: Callable[[], object] | None = None,
        after: Callable[[], object] | None = None,
    ) -> float:
        best = float("inf")
        for _ in range(5):
            elapsed = 0.0
            for _ in range(max(1, count // STEP_CHUNK)):
                if before is not None:
                    before()
                began = time.perf_counter()
                step()
                elapsed += time.perf_counter() - began
                if after is not None:
                    after()
            best = min(best, elapsed)
        return best / max(1, count // STEP_CHUNK) / STEP_CHUNK * 1e6

    def send_multipart() -> None:
        for frames in chunk:
            pub.send_multipart(frames)

    def send() -> None:
        for frames in chunk:
            send_frames(pub, frames)

    def recv_multipart() -> None:
        for _ in chunk:
            sub.recv_multipart(zmq.NOBLOCK)

    def recv() -> None:
        for _ in chunk:
            recv_frames(sub, zmq.NOBLOCK)

    def encode() -> None:
        for _ in chunk:
            encode_batch(batch)

    def decode() -> None:
        for _ in chunk:
            decode_batch(payload)

    def decode_spec() -> None:
        for _ in chunk:
            python_decode_batch(payload)

    try:
        while not sub.poll(10):  # a subscription takes effect on a later send
            send_frames(pub, chunk[0])
        while sub.poll(0):
            recv_frames(sub)
        return {
            "send_multipart (pyzmq)": timed(send_multipart, after=recv),
            "send_frames": timed(send, after=recv),
            "recv_multipart (pyzmq)": timed(recv_multipart, before=send),
            "recv_frames": timed(recv, before=send),
            "encode_batch": timed(encode),
            "decode_batch": timed(decode),
            "python_decode_batch": timed(decode_spec),
        }
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
        ctx.term()


def _load() -> str:
    """The 1, 5 and 15-minute load averages (a busy box reads above its CPU count)."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def print_steps(counts: dict[int, int]) -> None:
    """Print :func:`measure_steps` for each batch size, as a markdown table."""
    steps = {num_blocks: measure_steps(num_blocks, count) for num_blocks, count in counts.items()}
    print("\nCPU per 3-frame message of each step, inproc PUB/SUB in one process:")
    print(f"| {'step':<22} |" + "".join(f" µs, {n:>2}-block |" for n in steps))
    print(f"|{'-' * 24}|" + "".join(f"{'-' * 13}:|" for _ in steps))
    for name in steps[next(iter(steps))]:
        print(f"| {name:<22} |" + "".join(f" {costs[name]:>12.2f} |" for costs in steps.values()))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--sender``, be its sender child)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_events",
        description="Block events/s from EventPublisher to EventSubscriber over tcp "
        "loopback, beside raw pyzmq PUB/SUB of the same bytes.",
    )
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per row, median reported (default: 3, 1 with --quick)",
    )
    parser.add_argument("--sender", choices=("raw", "kvroute"), help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.sender:
        return run_sender(args.sender, args.blocks, args.count)
    repeats = args.repeats or (1 if args.quick else 3)
    counts = {1: 10_000, 32: 2_000} if args.quick else {1: 100_000, 32: 20_000}

    extra = f"libzmq {zmq.zmq_version()}, {native_text()}, load average {_load()}"
    print("bench_events:", describe(("pyzmq", "msgspec"), extra=extra))
    print(
        f"tcp loopback, sender and receiver in two processes, median of {repeats} runs"
        f"{' (--quick)' if args.quick else ''}"
    )
    print(
        f"| {'blocks/batch':>12} | {'path':<36} | {'block events/s':>14} "
        f"| {'batches/s':>9} | {'ratio':>5} | {'receiver CPU µs/batch':>21} |"
    )
    print(f"|{'-' * 13}:|{'-' * 38}|{'-' * 15}:|{'-' * 10}:|{'-' * 6}:|{'-' * 22}:|")
    missed = []
    for num_blocks, count in counts.items():
        # Rows interleaved within each repeat, so load changes hit every row alike.
        samples: dict[Pairing, list[Sample]] = {p: [] for p in PAIRINGS}
        for _ in range(repeats):
            for pairing in PAIRINGS:
                samples[pairing].append(measure(pairing, num_blocks, count))
        baseline = statistics.median(s.rate for s in samples[BASELINE])
        for pairing in PAIRINGS:
            rate = statistics.median(s.rate for s in samples[pairing])
            cpu_us = statistics.median(s.receiver_cpu_us for s in samples[pairing])
            print(
                f"| {num_blocks:>12} | {pairing.label:<36} | {rate:>14,.0f} | "
                f"{rate / num_blocks:>9,.0f} | {rate / baseline:>5.2f} | {cpu_us:>21.2f} |"
            )
            if pairing == TARGET_ROW and (
                rate < TARGET_EVENTS_PER_S or rate / baseline < TARGET_RATIO
            ):
                missed.append(f"{num_blocks}-block batches")
    print(
        f"targets: >= {TARGET_EVENTS_PER_S:,} block events/s and >= {TARGET_RATIO:.0%} of raw "
        "for EventPublisher -> EventSubscriber"
    )
    if missed:
        print(f"targets missed for: {', '.join(missed)}")

    print_steps(counts)
    print(f"load average at the end: {_load()} (other processes share the cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
