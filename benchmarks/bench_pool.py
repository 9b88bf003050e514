"""Benchmark: BlockPool cost per block on vLLM's operation mix, beside vLLM's own figures.

Rows follow the table "vLLM's BlockPool cost" in ``docs/vllm-compat.md`` (a 10,000
block pool, batches of 32 blocks of 16 tokens), plus the router's fast block key:

* alloc+free: ``get_new_blocks(32)`` then ``free_blocks`` of never-cached blocks;
* alloc+cache+free: ``get_new_blocks(32)`` (each reuses and evicts a cached block),
  ``cache_full_blocks`` of all 32, ``free_blocks`` in reverse; events off, then on (with a
  ``take_events`` drain per batch, as an engine step does);
* hit: ``get_cached_block`` for 32 cached blocks, ``touch``, ``free_blocks``;
* hashing: one 16-token block with ``sha256_cbor``, and with the router key (XXH3), alone
  and 32 blocks per call;
* the request level: ``get_computed_blocks`` of a 32-block hit, ``allocate_slots``,
  ``free`` (no vLLM figure).

Each figure is the median over repeats of µs per block. vLLM's figures were measured on the
same kind of machine (2 cores, CPython 3.11), so the ratio (ours / vLLM, lower is better)
compares like with like; a calibration loop timed in this run shows how fast this machine
is at plain Python.

Run: ``python -m benchmarks.bench_pool`` (``--quick`` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.environment import describe, native_text
from events.hashing import (
    BlockKey,
    hash_block_sha256_cbor,
    none_hash,
    python_block_keys,
    root_key,
    router_block_key,
    router_block_keys,
)
from pool.block_pool import BlockPool
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.request import BlockHasher, Request

__all__ = ["main"]

logger = logging.getLogger("benchmarks.bench_pool")

NUM_BLOCKS = 10_000
BATCH = 32
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Row:
    """One benchmark row: what is timed and vLLM's figure for it (µs per block)."""

    name: str
    vllm_us: float | None
    run: Callable[[int], None]  # runs `n` batches
    blocks_per_call: int


def _prepare_requests(num_requests: int, first_token: int) -> list[Request]:
    """Requests of one 32-block batch each, with distinct tokens (so distinct hashes)."""
    hasher = BlockHasher(BLOCK_SIZE)
    tokens_per_request = BATCH * BLOCK_SIZE
    return [
        Request(
            f"bench-{i}",
            range(first_token + i * tokens_per_request, first_token + (i + 1) * tokens_per_request),
            hasher,
        )
        for i in range(num_requests)
    ]


def alloc_free() -> Callable[[int], None]:
    pool = BlockPool(NUM_BLOCKS)

    def run(n: int) -> None:
        get, free = pool.get_new_blocks, pool.free_blocks
        for _ in range(n):
            free(get(BATCH))

    return run


def alloc_cache_free(requests: list[Request], *, events: bool) -> Callable[[int], None]:
    """Steady-state eviction: the pool is full of cached free blocks before timing starts.

    ``requests`` hold more blocks than the pool, and the free queue reuses the least
    recently freed block, so every allocated block evicts a cached one.
    """
    pool = BlockPool(NUM_BLOCKS, enable_kv_cache_events=events)
    state = {"next": 0}

    def run(n: int) -> None:
        get, cache, free, take = (
            pool.get_new_blocks,
            pool.cache_full_blocks,
            pool.free_blocks,
            pool.take_events,
        )
        i = state["next"]
        for _ in range(n):
            request = requests[i]
            i = (i + 1) % len(requests)
            blocks = get(BATCH)
            cache(request, blocks, 0, BATCH, BLOCK_SIZE)
            free(reversed(blocks))
            take()
        state["next"] = i

    run(len(requests))  # fill the pool with cached blocks
    assert pool.cached_block_hash_to_block.num_blocks == NUM_BLOCKS - 1
    return run


def hit_path(request: Request) -> Callable[[int], None]:
    pool = BlockPool(NUM_BLOCKS)
    blocks = pool.get_new_blocks(BATCH)
    pool.cache_full_blocks(request, blocks, 0, BATCH, BLOCK_SIZE)
    pool.free_blocks(reversed(blocks))
    hashes = request.block_hashes

    def run(n: int) -> None:
        get, touch, free = pool.get_cached_block, pool.touch, pool.free_blocks
        for _ in range(n):
            hits = [get(block_hash) for block_hash in hashes]
            touch(hits)  # type: ignore[arg-type]  # every hash is cached
            free(reversed(hits))  # type: ignore[arg-type]

    return run


def sha256_cbor_block() -> Callable[[int], None]:
    parent = none_hash()
    tokens = list(range(1, BLOCK_SIZE + 1))

    def run(n: int) -> None:
        for _ in range(n):
            hash_block_sha256_cbor(parent, tokens, None)

    return run


def router_key_block() -> Callable[[int], None]:
    parent = root_key()
    tokens = list(range(1, BLOCK_SIZE + 1))

    def run(n: int) -> None:
        for _ in range(n):
            router_block_key(parent, tokens)

    return run


def router_keys_batch(
    keys: Callable[[list[int], int, int], list[BlockKey]] = router_block_keys,
) -> Callable[[int], None]:
    parent = root_key()
    tokens = list(range(1, BATCH * BLOCK_SIZE + 1))

    def run(n: int) -> None:
        for _ in range(n):
            keys(tokens, BLOCK_SIZE, parent)

    return run


def manager_hit() -> Callable[[int], None]:
    """A request whose 32 full blocks are all cached: look up, allocate, free."""
    manager = KVCacheManager(KVCacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
    prompt = list(range(BATCH * BLOCK_SIZE + 1))  # the extra token keeps block 31 a hit
    warm = manager.make_request("warm", prompt)
    manager.allocate_slots(warm, warm.num_tokens)
    manager.free(warm)
    request = manager.make_request("bench", prompt)

    def run(n: int) -> None:
        get, allocate, free = manager.get_computed_blocks, manager.allocate_slots, manager.free
        for _ in range(n):
            hits, num_hit_tokens = get(request)
            allocate(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
            free(request)

    return run


def calibration() -> Callable[[int], None]:
    """A fixed plain-Python loop (attribute and list work, as a pool does) per call."""

    class Node:
        __slots__ = ("next", "value")

        def __init__(self) -> None:
            self.next: Node | None = None
            self.value = 0

    nodes = [Node() for _ in range(BATCH)]

    def run(n: int) -> None:
        for _ in range(n):
            out = []
            for node in nodes:
                node.value += 1
                out.append(node)

    return run


def median_us_per_block(row: Row, calls: int, repeats: int) -> tuple[float, float]:
    """Median and minimum over ``repeats`` of µs per block for ``calls`` calls."""
    row.run(max(1, calls // 10))  # warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        row.run(calls)
        elapsed_ns = time.perf_counter_ns() - start
        samples.append(elapsed_ns / 1000 / (calls * row.blocks_per_call))
    return statistics.median(samples), min(samples)


def build_rows() -> list[Row]:
    """The benchmark rows, set up (pools filled, hashes computed) and ready to time."""
    num_requests = (NUM_BLOCKS // BATCH) * 5 // 4  # 25 % more blocks than the pool holds
    requests = _prepare_requests(num_requests, first_token=1)
    hit_request = _prepare_requests(1, first_token=10_000_000)[0]
    return [
        Row("get_new_blocks(32) + free_blocks (uncached)", 0.39, alloc_free(), BATCH),
        Row(
            "alloc 32 + cache_full_blocks + free, eviction, events off",
            1.64,
            alloc_cache_free(requests, events=False),
            BATCH,
        ),
        Row(
            "same, events on (+ take_events per batch)",
            3.38,
            alloc_cache_free(requests, events=True),
            BATCH,
        ),
        Row("get_cached_block x32 + touch + free (a hit)", 0.73, hit_path(hit_request), BATCH),
        Row("sha256_cbor hash of one 16-token block", 2.61, sha256_cbor_block(), 1),
        Row("router key (XXH3) of one 16-token block", None, router_key_block(), 1),
        Row("router keys of 32 blocks in one call, per block", None, router_keys_batch(), BATCH),
        Row("same, the Python reference", None, router_keys_batch(python_block_keys), BATCH),
        Row("KVCacheManager: 32-block hit, allocate_slots, free", None, manager_hit(), BATCH),
        Row("calibration: plain-Python loop, per element", None, calibration(), BATCH),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_pool",
        description="BlockPool cost per block on vLLM's operation mix, beside vLLM's figures.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a seconds-long smoke run (few repeats; figures are noisy)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repeats per row, the median is reported (default: 15, 3 with --quick)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    repeats = args.repeats or (3 if args.quick else 15)
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    target_s = 0.01 if args.quick else 0.2  # wall time of one repeat

    print("bench_pool:", describe(("msgspec", "cbor2", "xxhash"), extra=native_text()))
    print(
        f"pool of {NUM_BLOCKS} blocks, batches of {BATCH} blocks of {BLOCK_SIZE} tokens, "
        f"median of {repeats} repeats{' (--quick)' if args.quick else ''}"
    )
    started = time.perf_counter()
    rows = build_rows()
    logger.info("set-up took %.1f s", time.perf_counter() - started)

    header = f"| {'operation':<58} | {'µs/block':>8} | {'min':>6} | {'vLLM':>5} | {'ratio':>5} |"
    print(header)
    print(f"|{'-' * 60}|{'-' * 9}:|{'-' * 7}:|{'-' * 6}:|{'-' * 6}:|")
    missed = []
    for row in rows:
        # Size one repeat to about target_s from a short probe.
        probe_us, _ = median_us_per_block(row, 20, 1)
        calls = max(20, int(target_s * 1e6 / (probe_us * row.blocks_per_call)))
        median_us, min_us = median_us_per_block(row, calls, repeats)
        if row.vllm_us is None:
            vllm, ratio = "", ""
        else:
            vllm, ratio = f"{row.vllm_us:.2f}", f"{median_us / row.vllm_us:.2f}"
            if median_us > row.vllm_us:
                missed.append(row.name)
        print(f"| {row.name:<58} | {median_us:>8.3f} | {min_us:>6.3f} | {vllm:>5} | {ratio:>5} |")
    print("ratio = ours / vLLM (<= 1.00 meets the target); vLLM figures from docs/vllm-compat.md")
    if missed:
        print(f"rows above vLLM's figure: {', '.join(missed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
