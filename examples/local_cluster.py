"""Run a local kvroute cluster from Python and compare two routing policies.

What ``kvroute cluster`` does, as a library call: start a private Redis, N kvroute workers
and a router on 127.0.0.1 (once per policy, caches cold each time), send a workload
through the router, and read the figures off the report.

    python examples/local_cluster.py            # 2 workers, a 24-request chat workload
    python examples/local_cluster.py --workers 4 --requests 120 --workload mooncake

``mooncake`` slices the Mooncake trace beside the checkout when present, else the built-in
generated trace (``docs/workload.md``). Process logs go to a temporary directory, removed at
the end unless the run fails.
"""

from __future__ import annotations

import argparse
import sys

from router.cluster.processes import log_directory
from router.cluster.report import format_report
from router.cluster.runner import ClusterConfig, run_cluster
from router.cluster.trace_source import choose_trace, trace_workload
from router.cluster.workload import Workload, chat_workload


def build_workload(name: str, num_requests: int) -> Workload:
    """A chat workload of about ``num_requests`` requests, or a trace slice."""
    if name == "chat":
        num_turns = 3
        return chat_workload(num_sessions=max(1, num_requests // num_turns), num_turns=num_turns)
    source = choose_trace(None)
    print(source.describe(), file=sys.stderr)
    return trace_workload(source, num_requests=num_requests, num_families=max(1, num_requests // 4))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--requests", type=int, default=24, help="requests (default 24)")
    parser.add_argument("--workload", choices=("chat", "mooncake"), default="chat")
    parser.add_argument("--redis", help="an existing Redis URL (default: start one)")
    args = parser.parse_args(argv)

    workload = build_workload(args.workload, args.requests)
    with log_directory(None, prefix="kvroute-example-") as logs:
        config = ClusterConfig(
            num_workers=args.workers,
            policies=("cache_aware", "round_robin"),
            redis_url=args.redis,
            num_blocks=256,
            concurrency=2,
            log_dir=logs.path,
        )
        print(f"running {workload.description} on {config.num_workers} workers", file=sys.stderr)
        report = run_cluster(workload, config)
    print(format_report(report))

    aware, baseline = report.runs
    print(
        f"\ncache_aware served {aware.cached_tokens} prompt tokens from cache, "
        f"round_robin {baseline.cached_tokens}"
    )
    failed = aware.num_failed + baseline.num_failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
