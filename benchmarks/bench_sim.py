"""Benchmark: routing policies in the trace simulator, against the infinite cache and a pooled LRU.

Two suites, each replaying traces over simulated workers (real BlockPools, the router's
real policies and in-memory index fed by the pools' events):

* ``policies`` (default): the trace ``kvroute sim`` would take (``--trace``, else the
  Mooncake synthetic trace beside the checkout when present, else the built-in generated
  trace: ``docs/workload.md``) over 8 workers of 5,859 blocks of 512 tokens, once per
  policy: each policy's prefix hit rate with its ratio to the infinite-cache ideal and
  to ``round_robin`` measured in the same run, its load imbalance (max/mean requests and
  prefill tokens), simulated TTFT and the wall time of the run.
  Targets: ``cache_aware`` at >= 97 % of the ideal with max/mean load <= 1.25, every
  policy in under a minute in all.
* ``capacity``: traces whose working set is several times the cluster's cache, where the
  infinite cache is out of reach and the bound is one pooled LRU cache of the cluster's
  capacity (:mod:`router.sim.bounds`): the same default trace on small caches (8 and 16
  workers x 686 blocks), two time-stretched copies of it with their own ids (8 x 1,830),
  generated chat sessions over Zipf-popular system prompts (8 x 400), and ``--trace FILE``
  if given. Per scenario: ``cache_aware`` (current defaults), ``cache_aware`` with the
  weights it had before the fair-share term (prefill 8, no fair share) and ``round_robin``,
  each as hit rate over the pooled-LRU bound, max/mean load and mean TTFT. Target:
  ``cache_aware`` >= 1.00x the bound with max/mean load <= 1.25.

Run: ``python -m benchmarks.bench_sim [--suite policies|capacity]`` (both by default;
``--quick``: the first 600 requests of the policies suite and 300 of each capacity
scenario, a smoke run).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.environment import describe
from router.cli.sim import pool_cache_factory, run_policies
from router.cluster.trace_source import TraceSource, choose_trace
from router.routing.cost import CostWeights
from router.routing.policies import POLICY_NAMES, PolicyConfig
from router.sim.engine import SimConfig
from router.sim.report import PolicyResult, format_table
from router.sim.synthetic import chat_sessions, shifted_copies
from router.sim.trace import SimRequest, load_trace, to_requests

__all__ = ["main"]

QUICK_REQUESTS = 600
QUICK_CAPACITY_REQUESTS = 300
TARGET_RATIO_TO_IDEAL = 0.97
TARGET_RATIO_TO_POOLED_LRU = 1.00
TARGET_LOAD_IMBALANCE = 1.25
TARGET_CPU_S = 60.0  # "under a minute": wall time of this single-threaded run when idle
BEFORE = CostWeights(prefill=8.0, fair_share=0.0)
"""The cost weights before the fair-share term, for the ``before`` column."""


@dataclass(frozen=True)
class Scenario:
    """One capacity-suite run: a trace and a cluster."""

    name: str
    trace: str
    requests: list[SimRequest]
    num_workers: int
    capacity_blocks: int

    @property
    def working_set_ratio(self) -> float:
        """Distinct trace blocks over the cluster's blocks."""
        distinct = len({h for r in self.requests for h in r.hash_ids})
        return distinct / (self.num_workers * self.capacity_blocks)


def _policies_suite(args: argparse.Namespace) -> None:
    source = choose_trace(args.trace)
    requests = to_requests(source.records(QUICK_REQUESTS if args.quick else None))
    config = SimConfig(speed=args.speed)
    print(source.describe())
    print(
        f"{len(requests)} requests of {source.name}; {config.num_workers} "
        f"workers x {config.capacity_blocks} blocks of {config.block_size} tokens; speed "
        f"{config.speed}; prefill {config.prefill_tokens_per_s:g} tokens/s, decode "
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


def scenarios(
    base: TraceSource,
    limit: int | None,
    extra: str | None,
    extra_workers: int,
    extra_blocks: int,
) -> list[Scenario]:
    """The capacity suite's scenarios (each trace cut to ``limit`` requests if given)."""
    records = base.records()
    cut = slice(None, limit)
    out = [
        Scenario(f"{base.name}, 8 x 686", base.name, to_requests(records[cut]), 8, 686),
        Scenario(f"{base.name}, 16 x 686", base.name, to_requests(records[cut]), 16, 686),
        Scenario(
            f"{base.name} x2, 8 x 1830",
            "2 stretched copies, own ids",
            to_requests(shifted_copies(records, 2)[cut]),
            8,
            1830,
        ),
        Scenario("chats, 8 x 400", "chat_sessions()", to_requests(chat_sessions()[cut]), 8, 400),
    ]
    if extra:
        requests = load_trace(extra, limit)
        name = f"{Path(extra).name}, {extra_workers} x {extra_blocks}"
        out.append(Scenario(name, extra, requests, extra_workers, extra_blocks))
    return out


def _run(scenario: Scenario, policy: str, weights: CostWeights) -> PolicyResult:
    config = SimConfig(
        num_workers=scenario.num_workers,
        capacity_blocks=scenario.capacity_blocks,
        policy=PolicyConfig(weights=weights),
    )
    (result,) = run_policies(scenario.requests, [policy], config, pool_cache_factory())
    return result


def capacity_table(
    rows: Sequence[tuple[Scenario, PolicyResult, PolicyResult, PolicyResult]],
) -> str:
    """The capacity suite's table: per scenario, each run's ratio to the pooled LRU."""
    header = (
        f"{'scenario':<34}{'ws/cache':>9}{'LRU blk':>9}{'aware/LRU':>10}{'load':>6}"
        f"{'TTFT':>7}{'before/LRU':>11}{'load':>6}{'TTFT':>7}{'rr/LRU':>8}"
    )
    lines = [header, "-" * len(header)]
    for scenario, aware, before, rr in rows:
        assert aware.pooled_lru is not None
        lines.append(
            f"{scenario.name:<34}{scenario.working_set_ratio:>9.1f}"
            f"{aware.pooled_lru.hit_rate_blocks:>9.2%}{aware.ratio_to_pooled_lru:>10.3f}"
            f"{aware.load_imbalance:>6.2f}{aware.ttft_mean_s:>7.2f}"
            f"{before.ratio_to_pooled_lru:>11.3f}{before.load_imbalance:>6.2f}"
            f"{before.ttft_mean_s:>7.2f}{rr.ratio_to_pooled_lru:>8.3f}"
        )
    return "\n".join(lines)


def _capacity_suite(args: argparse.Namespace) -> None:
    limit = QUICK_CAPACITY_REQUESTS if args.quick else None
    base = choose_trace(None)  # the default trace; --trace feeds the policies suite
    print(base.describe())
    rows = []
    found = scenarios(base, limit, args.extra_trace, args.extra_workers, args.extra_blocks)
    for scenario in found:
        defaults = CostWeights()
        rows.append(
            (
                scenario,
                _run(scenario, "cache_aware", defaults),
                _run(scenario, "cache_aware", BEFORE),
                _run(scenario, "round_robin", defaults),
            )
        )
    print("pooled-LRU bound: one LRU cache of all workers' blocks (perfect routing, LRU eviction)")
    print(capacity_table(rows))
    met = all(
        (aware.ratio_to_pooled_lru or 0.0) >= TARGET_RATIO_TO_POOLED_LRU
        and aware.load_imbalance <= TARGET_LOAD_IMBALANCE
        for _, aware, _, _ in rows
    )
    verdict = (
        "quick run: targets apply to full traces"
        if args.quick
        else ("targets met" if met else "targets MISSED")
    )
    print(
        f"target: cache_aware >= {TARGET_RATIO_TO_POOLED_LRU:.2f}x the pooled LRU with max/mean "
        f"load <= {TARGET_LOAD_IMBALANCE} in every scenario: {verdict}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_sim", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few hundred requests per run")
    parser.add_argument(
        "--suite", choices=("policies", "capacity", "all"), default="all", help="what to run"
    )
    parser.add_argument("--trace", help="Mooncake-format trace of the policies suite")
    parser.add_argument("--speed", type=float, default=1.0, help="trace time divided by X")
    parser.add_argument("--extra-trace", help="a further capacity scenario: this trace...")
    parser.add_argument("--extra-workers", type=int, default=8, help="...on this many workers")
    parser.add_argument("--extra-blocks", type=int, default=5859, help="...of this many blocks")
    args = parser.parse_args(argv)
    print("bench_sim:", describe(("msgspec", "xxhash")))
    if args.suite in ("policies", "all"):
        _policies_suite(args)
    if args.suite in ("capacity", "all"):
        _capacity_suite(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
