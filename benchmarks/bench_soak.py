"""Soak: sustained unique-prefix churn through the router; memory must stay bounded.

A :class:`~benchmarks.bench_throughput.LocalStack` (embedded Redis, ``--workers`` real
workers of ``--num-blocks`` blocks each, one router) takes ``--clients`` closed-loop
clients sending prompts that never repeat (every block a new prefix, so every request
evicts and every eviction is a ``BlockRemoved`` the index must apply) for ``--duration-min``
(10 by default; ``--quick``: 20 seconds). Every ``--sample-s`` it records the index's
entries, Redis ``used_memory`` and the router's RSS.

Claims, checked at the end (exit code 1 if the first fails):

* index entries never exceed the configured capacity, ``workers x (num_blocks - 1)``
  (the null block holds nothing);
* Redis memory and router RSS stop growing: the peak of the last third of the run is
  compared with the peak of the middle third (the first third is warm-up).

The curve is plotted to ``--plot`` (``benchmarks/soak.png`` for a full run).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

from benchmarks.bench_throughput import LocalStack
from benchmarks.environment import describe
from events.cli.flags import add_flag
from router.index.redis_index import RedisPrefixIndex
from router.store.connection import connect
from router.store.layout import KeyLayout

PLOT_DEFAULT = Path(__file__).resolve().parent / "soak.png"


@dataclass(frozen=True)
class Sample:
    """One observation of the running stack."""

    t_s: float
    num_requests: int
    num_errors: int
    num_entries: int
    redis_bytes: int
    router_rss_bytes: int


async def soak(
    stack: LocalStack, *, clients: int, seconds: float, sample_s: float, prompt_tokens: int
) -> list[Sample]:
    """Drive unique prompts through the router for ``seconds``, sampling every ``sample_s``."""
    assert stack.redis is not None
    client = await connect(stack.redis.url)
    index = RedisPrefixIndex(client, KeyLayout(stack.namespace))
    router = psutil.Process(stack.router_pid)
    done = errors = 0
    start = time.monotonic()
    stop_at = start + seconds
    url = f"{stack.router_url}/v1/completions"

    async def one_client(k: int, session: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        rng = random.Random(k)
        while time.monotonic() < stop_at:
            body = {"prompt": [rng.randrange(256) for _ in range(prompt_tokens)], "max_tokens": 1}
            async with session.post(url, json=body) as response:
                await response.read()
            if response.status == 200:
                done += 1
            else:
                errors += 1

    async def sampler() -> list[Sample]:
        samples = []
        while True:
            stats = await index.stats()
            samples.append(
                Sample(
                    time.monotonic() - start,
                    done,
                    errors,
                    stats.num_entries,
                    stats.memory_bytes or 0,
                    router.memory_info().rss,
                )
            )
            last = samples[-1]
            print(
                f"  t={last.t_s:6.0f}s requests={last.num_requests:7d} errors={last.num_errors} "
                f"entries={last.num_entries:6d} redis={last.redis_bytes / 2**20:6.1f} MiB "
                f"router_rss={last.router_rss_bytes / 2**20:6.1f} MiB",
                flush=True,
            )
            if time.monotonic() >= stop_at:
                return samples
            await asyncio.sleep(min(sample_s, max(stop_at - time.monotonic(), 0.0)))

    timeout = aiohttp.ClientTimeout(total=120)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            sampling = asyncio.create_task(sampler())
            await asyncio.gather(*(one_client(k, session) for k in range(clients)))
            return await sampling
    finally:
        await client.aclose()


def growth(samples: list[Sample], attr: str) -> float:
    """Peak of the last third over the peak of the middle third (1.0: flat)."""
    n = len(samples)
    middle = [getattr(s, attr) for s in samples[n // 3 : 2 * n // 3]] or [1]
    last = [getattr(s, attr) for s in samples[2 * n // 3 :]] or [1]
    return float(max(last) / max(max(middle), 1))


def plot(samples: list[Sample], capacity: int, path: Path, title: str) -> None:
    """Entries, Redis memory and router RSS over time, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t_s / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(t, [s.num_entries for s in samples], label="index entries")
    axes[0].axhline(capacity, color="red", linestyle="--", label="capacity")
    axes[0].set_ylabel("entries")
    axes[0].legend(loc="lower right")
    axes[1].plot(t, [s.redis_bytes / 2**20 for s in samples])
    axes[1].set_ylabel("Redis used_memory (MiB)")
    axes[2].plot(t, [s.router_rss_bytes / 2**20 for s in samples])
    axes[2].set_ylabel("router RSS (MiB)")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the soak; returns 1 if the index ever held more entries than the capacity."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_soak",
        description="Sustained unique-prefix churn through a local router: index entries, "
        "Redis memory and router RSS must stay bounded by the configured capacity.",
    )
    parser.add_argument("--quick", action="store_true", help="a 20-second smoke run")
    add_flag(
        parser, "--duration-min", aliases=("--minutes",), type=float, default=10.0,
        meaning="duration in minutes",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, default=2, help="workers (default: 2)")
    parser.add_argument(
        "--num-blocks", type=int, default=256, help="KV blocks per worker (default: 256)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default: 16)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default: 8)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=128, help="tokens per unique prompt (default: 128)"
    )
    add_flag(
        parser, "--sample-s", type=float, default_text="10; --quick: 1",
        meaning="seconds between samples",
    )  # fmt: skip
    parser.add_argument(
        "--plot",
        default=None,
        help=f"PNG of the curve (default: {PLOT_DEFAULT.name} beside this file; a temp file "
        "with --quick)",
    )
    parser.add_argument("--log-dir", default=None, help="process logs (default: a temp dir)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    seconds = 20.0 if args.quick else args.duration_min * 60
    sample_s = args.sample_s or (1.0 if args.quick else 10.0)
    tag = uuid.uuid4().hex[:8]
    plot_path = Path(args.plot) if args.plot else (
        Path(f"/tmp/kvroute-soak-{tag}.png") if args.quick else PLOT_DEFAULT
    )  # fmt: skip
    log_dir = Path(args.log_dir or f"/tmp/kvroute-bench-soak-{tag}")
    capacity = args.workers * (args.num_blocks - 1)
    print("bench_soak:", describe(("aiohttp", "redis", "msgspec")))
    print(f"{args.workers} workers x {args.num_blocks} blocks of {args.block_size} tokens "
          f"(capacity {capacity} entries), {args.clients} clients, unique "
          f"{args.prompt_tokens}-token prompts, {seconds:.0f} s; logs in {log_dir}")  # fmt: skip
    with LocalStack(
        log_dir, num_workers=args.workers, num_blocks=args.num_blocks, block_size=args.block_size
    ) as stack:
        samples = asyncio.run(
            soak(
                stack,
                clients=args.clients,
                seconds=seconds,
                sample_s=sample_s,
                prompt_tokens=args.prompt_tokens,
            )
        )
        assert stack.group is not None
        stack.group.check_alive()
    last = samples[-1]
    peak_entries = max(s.num_entries for s in samples)
    elapsed = max(last.t_s, 1e-9)
    rows = [
        ("requests served (errors)", f"{last.num_requests} ({last.num_errors})", ""),
        ("requests/s", f"{last.num_requests / elapsed:.1f}", ""),
        ("peak index entries / capacity", f"{peak_entries} / {capacity}",
         f"{peak_entries / capacity:.2f}"),
        ("Redis used_memory at end (MiB)", f"{last.redis_bytes / 2**20:.1f}",
         f"{growth(samples, 'redis_bytes'):.2f}"),
        ("router RSS at end (MiB)", f"{last.router_rss_bytes / 2**20:.1f}",
         f"{growth(samples, 'router_rss_bytes'):.2f}"),
    ]  # fmt: skip
    print(f"\n{'figure':<34} {'value':>16} {'ratio':>7}")
    for name, value, ratio in rows:
        print(f"{name:<34} {value:>16} {ratio:>7}")
    print("ratios: entries to the capacity (must be <= 1.00); memory and RSS: peak of the last "
          "third of the run to the peak of the middle third (1.00 = flat)")  # fmt: skip
    plot(samples, capacity, plot_path, f"kvroute soak: {seconds / 60:.0f} min unique-prefix churn")
    print(f"plot: {plot_path}")
    if peak_entries > capacity:
        print(f"FAIL: the index held {peak_entries} entries, capacity {capacity}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
