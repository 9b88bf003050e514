"""Idle cost of a router at fleet scale: CPU and Redis commands with N quiet workers.

One router process (``kvroute router``) on a private Redis; ``--workers`` lightweight
workers (a real ZeroMQ PUB socket and HTTP port each, answering ``/health``,
``/v1/snapshot`` and ``/v1/models``: :mod:`tests.support.fleet`, run from the checkout)
registered through ``POST /v1/workers`` and then left without traffic. Measured over
``--window-s`` after ``--settle-s`` (the polls back off to their resting rate first):

* the router's CPU, in % of one core (``utime + stime`` of ``/proc/PID/stat``);
* Redis commands per second: the delta of ``INFO commandstats`` (commands that scripts
  run counted too), the busiest commands listed.

The baseline is the same router in the same run with no worker registered; the table
gives the cost per worker and the ratio. Targets: at 1,000 workers, router ≤ 5 % of a
core and ≤ 200 Redis commands/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.environment import describe
from events.cli.flags import add_flag
from router.cluster.processes import ProcessGroup, wait_healthy
from router.store.server import RedisServer, find_redis_server, free_port

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support.fleet: the workers live in the checkout

from tests.support.fleet import Fleet, register  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Cost:
    """What the router cost over one window."""

    cpu_percent: float
    commands_per_s: float
    top: list[tuple[str, float]]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _commands(stats: dict[str, Any]) -> Counter[str]:
    """Calls per command from ``INFO commandstats`` (redis-py's parsed form)."""
    out: Counter[str] = Counter()
    for name, value in stats.items():
        if name.startswith("cmdstat_") and isinstance(value, dict):
            out[name[len("cmdstat_") :]] = int(value["calls"])
    return out


async def measure(redis: Any, pid: int, window_s: float) -> Cost:
    """The router's CPU and the Redis commands over ``window_s``, at rest."""
    calls0, cpu0, t0 = _commands(await redis.info("commandstats")), _cpu_s(pid), time.monotonic()
    await asyncio.sleep(window_s)
    # The INFO that reads the counters counts itself once per call: not the router's.
    calls1, cpu1, t1 = _commands(await redis.info("commandstats")), _cpu_s(pid), time.monotonic()
    delta = calls1 - calls0
    delta["info"] -= 1
    elapsed = t1 - t0
    top = [(name, n / elapsed) for name, n in delta.most_common(6) if n > 0]
    return Cost(100 * (cpu1 - cpu0) / elapsed, delta.total() / elapsed, top)


async def run(args: argparse.Namespace, log_dir: Path) -> tuple[Cost, Cost]:
    import redis.asyncio as aioredis

    group = ProcessGroup(log_dir, stop_timeout_s=30.0)
    with RedisServer() as server, Fleet(args.workers) as fleet:
        redis = aioredis.from_url(server.url)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        try:
            router = group.start(
                "router",
                [sys.executable, "-m", "router", "router", "--redis", server.url,
                 "--namespace", f"fleet-{uuid.uuid4().hex[:8]}", "--port", str(port),
                 "--lease-ttl-s", str(args.lease_ttl_s), "--log-level", "WARNING"],
            )  # fmt: skip
            pid = router.pid
            async with aiohttp.ClientSession() as session:
                await wait_healthy(session, url, group, time.monotonic() + 120)
            await asyncio.sleep(args.settle_s)
            baseline = await measure(redis, pid, args.window_s)
            started = time.monotonic()
            statuses = Counter(await register(url, fleet.bodies))
            if statuses != {201: args.workers}:
                raise SystemExit(f"registration answered {dict(statuses)}")
            print(f"registered {args.workers} workers in {time.monotonic() - started:.1f} s")
            await asyncio.sleep(args.settle_s)
            group.check_alive()
            loaded = await measure(redis, pid, args.window_s)
            return baseline, loaded
        finally:
            group.stop()
            await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_fleet",
        description="A router's idle CPU and Redis commands/s with N registered, quiet "
        "workers, against the same router with none.",
    )
    parser.add_argument("--quick", action="store_true", help="50 workers, short windows")
    parser.add_argument("--workers", type=int, default=1000, help="workers (default: 1000)")
    add_flag(parser, "--settle-s", type=float, default=45.0,
             meaning="seconds before each window (polls back off meanwhile)")  # fmt: skip
    add_flag(parser, "--window-s", type=float, default=30.0, meaning="seconds measured")
    add_flag(parser, "--lease-ttl-s", type=float, default=10.0,
             meaning="the router's --lease-ttl-s: leases are renewed every third of it, "
             "one command per worker")  # fmt: skip
    parser.add_argument("--log-dir", type=Path, default=None, help="where the router logs")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.settle_s, args.window_s = 50, 3.0, 3.0
    print(describe(["redis", "pyzmq", "aiohttp"], redis_server=find_redis_server()))
    print(f"load average at start: {os.getloadavg()[0]:.2f} (a shared box inflates CPU)")
    log_dir = args.log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "kvroute-bench-fleet"
    log_dir.mkdir(parents=True, exist_ok=True)
    baseline, loaded = asyncio.run(run(args, log_dir))
    n = args.workers
    print()
    print("| router at rest | CPU (% of a core) | Redis commands/s |")
    print("|---|---:|---:|")
    print(f"| 0 workers (baseline) | {baseline.cpu_percent:.2f} | {baseline.commands_per_s:.1f} |")
    print(f"| {n} workers, --lease-ttl-s {args.lease_ttl_s:g} | {loaded.cpu_percent:.2f} | "
          f"{loaded.commands_per_s:.1f} |")  # fmt: skip
    per_cpu = (loaded.cpu_percent - baseline.cpu_percent) / n
    per_cmd = (loaded.commands_per_s - baseline.commands_per_s) / n
    print(f"| per worker (difference / {n}) | {per_cpu:.4f} | {per_cmd:.3f} |")
    ratio_cpu = loaded.cpu_percent / max(baseline.cpu_percent, 0.01)
    ratio_cmd = loaded.commands_per_s / max(baseline.commands_per_s, 0.01)
    print(f"| ratio to baseline | {ratio_cpu:.2f} | {ratio_cmd:.2f} |")
    print()
    print("busiest Redis commands/s, baseline: "
          + ", ".join(f"{c} {r:.1f}" for c, r in baseline.top))  # fmt: skip
    print(f"busiest Redis commands/s, {n} workers: "
          + ", ".join(f"{c} {r:.1f}" for c, r in loaded.top))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
