"""``kvroute bench`` (also ``python -m benchmarks``): runs every ``benchmarks/bench_*.py``.

Each benchmark runs in its own process (``python -m benchmarks.NAME``), one after the
other so they do not share the cores, with its output passed through. A summary table
of exit codes and wall times ends the run; the exit code is 1 when any benchmark failed
or timed out. ``--quick`` passes ``--quick`` to each (seconds-long smoke runs, as CI
does, so no benchmark can rot).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Final

__all__ = ["discover", "main"]

BENCH_DIR: Final = Path(__file__).resolve().parent


def discover() -> list[str]:
    """Names of the benchmark modules (``bench_*.py`` beside this file), sorted."""
    return sorted(path.stem for path in BENCH_DIR.glob("bench_*.py"))


def _parser(names: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute bench",
        description="Run every kvroute benchmark (benchmarks/bench_*.py), one at a time, and "
        "summarise their exit codes and wall times. Each prints its own table with the "
        "versions, the machine and ratios to a baseline measured in the same run.",
        epilog=f"benchmarks found: {', '.join(names) or 'none'}",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="pass --quick to each benchmark: a seconds-long smoke run (what CI runs)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this benchmark (repeatable; with or without the bench_ prefix)",
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="NAME",
        help="do not run this benchmark (repeatable), e.g. --skip soak for a full run "
        "without the 10-minute soak",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="stop a benchmark that runs longer than this and count it as failed "
        "(default: no limit; 600 with --quick)",
    )
    parser.add_argument("--list", action="store_true", help="print the benchmark names and exit")
    return parser


def _normalise(name: str) -> str:
    return name if name.startswith("bench_") else f"bench_{name}"


def _run_one(name: str, quick: bool, timeout_s: float | None) -> tuple[str, float]:
    argv = [sys.executable, "-m", f"benchmarks.{name}", *(["--quick"] if quick else [])]
    print(f"\n== {' '.join(['python', *argv[1:]])}", flush=True)
    start = time.monotonic()
    try:
        code = subprocess.run(argv, cwd=BENCH_DIR.parent, timeout=timeout_s, check=False).returncode
        outcome = "ok" if code == 0 else f"exit {code}"
    except subprocess.TimeoutExpired:
        outcome = f"timeout after {timeout_s:.0f} s"
    return outcome, time.monotonic() - start


def main(argv: list[str]) -> int:
    """Run ``kvroute bench``; returns 0 when every chosen benchmark succeeded."""
    names = discover()
    args = _parser(names).parse_args(argv)
    if args.list:
        print("\n".join(names))
        return 0
    unknown = [n for n in args.only + args.skip if _normalise(n) not in names]
    if unknown:
        print(f"kvroute bench: unknown benchmark(s) {unknown}; have {names}", file=sys.stderr)
        return 2
    chosen = [n for n in names if not args.only or n in map(_normalise, args.only)]
    chosen = [n for n in chosen if n not in map(_normalise, args.skip)]
    timeout_s = args.timeout_s if args.timeout_s is not None else (600.0 if args.quick else None)
    results = [(name, *_run_one(name, args.quick, timeout_s)) for name in chosen]
    width = max((len(name) for name, _, _ in results), default=9)
    print(f"\n{'benchmark'.ljust(width)}  {'outcome':<22} {'wall s':>8}")
    for name, outcome, seconds in results:
        print(f"{name.ljust(width)}  {outcome:<22} {seconds:>8.1f}")
    failed = [name for name, outcome, _ in results if outcome != "ok"]
    if failed:
        print(f"kvroute bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
