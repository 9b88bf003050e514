"""Benchmark: routing policies on a Mooncake-format trace, in the trace simulator.

Replays the trace (``--trace``, else the Mooncake synthetic trace beside the checkout when
present, else the built-in generated trace: ``docs/workload.md``) over 8 simulated
workers of 5,859 blocks of 512 tokens each (real BlockPools, the router's real policies
and in-memory index fed by the pools' events) once per policy, and prints each policy's
prefix hit rate with its ratio to the infinite-cache ideal and to ``round_robin``
measured in the same run, its load imbalance (max/mean requests and prefill tokens),
simulated TTFT and the wall time of the run. Targets: ``cache_aware`` at >= 97 % of the
ideal with max/mean load <= 1.25, every policy in under a minute in all.

Run: ``python -m benchmarks.bench_sim`` (``--quick``: the first 600 requests only).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.environment import describe
from router.cli.sim import pool_cache_factory, run_policies
from router.cluster.trace_source import choose_trace
from router.routing.policies import POLICY_NAMES
from router.sim.engine import SimConfig
from router.sim.report import format_table
from router.sim.trace import to_requests

__all__ = ["main"]

QUICK_REQUESTS = 600
TARGET_RATIO_TO_IDEAL = 0.97
TARGET_LOAD_IMBALANCE = 1.25
TARGET_CPU_S = 60.0  # "under a minute": wall time of this single-threaded run when idle


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_sim", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="first 600 requests only")
    parser.add_argument(
        "--trace", help="Mooncake-format trace (default: as `kvroute sim` chooses, see above)"
    )
    parser.add_argument("--speed", type=float, default=1.0, help="trace time divided by X")
    args = parser.parse_args(argv)

    source = choose_trace(args.trace)
    requests = to_requests(source.records(QUICK_REQUESTS if args.quick else None))
    config = SimConfig(speed=args.speed)
    print("bench_sim:", describe(("msgspec", "xxhash")))
    print(source.describe())
    print(
        f"{len(requests)} requests of {source.name}; {config.num_workers} workers x "
        f"{config.capacity_blocks} blocks of {config.block_size} tokens; speed {config.speed}; "
        f"prefill {config.prefill_tokens_per_s:g} tokens/s, decode "
        f"{config.decode_s_per_token:g} s/token"
    )
    started_s, started_cpu_s = time.perf_counter(), time.process_time()
    results = run_policies(requests, POLICY_NAMES, config, pool_cache_factory())
    wall_s = time.perf_counter() - started_s
    cpu_s = time.process_time() - started_cpu_s
    print(format_table(results, baseline="round_robin"))
    best = next(r for r in results if r.policy == "cache_aware")
    verdict = "quick run: targets apply to the full trace"
    if not args.quick:
        met = (
            best.ratio_to_ideal >= TARGET_RATIO_TO_IDEAL
            and best.load_imbalance <= TARGET_LOAD_IMBALANCE
            and cpu_s < TARGET_CPU_S
        )
        verdict = "targets met" if met else "targets MISSED"
    print(
        f"cache_aware: {best.ratio_to_ideal:.1%} of the ideal (target >= "
        f"{TARGET_RATIO_TO_IDEAL:.0%}), max/mean load {best.load_imbalance:.2f} (target <= "
        f"{TARGET_LOAD_IMBALANCE}); all policies in {cpu_s:.1f} CPU s, {wall_s:.1f} s wall "
        f"(target < {TARGET_CPU_S:.0f} s on an idle machine, i.e. CPU s): {verdict}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
