"""The ``kvroute`` command line: dispatches a subcommand to the module that owns it.

Subcommand modules are imported only when chosen, so ``kvroute router`` never imports
torch and ``kvroute worker`` never imports the router. Each module exposes
``main(argv: list[str]) -> int`` and builds its own argument parser. ``kvroute`` alone
prints the usage and exits 2, like any command missing its argument; ``kvroute --help``
prints it and exits 0; ``kvroute --version`` prints the installed version.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Sequence
from typing import Final, NamedTuple

__all__ = ["COMMANDS", "main"]


class Command(NamedTuple):
    """A subcommand: the module whose ``main(argv)`` runs it, and a one-line summary."""

    module: str
    summary: str


COMMANDS: Final[dict[str, Command]] = {
    "bench": Command("router.cli.bench", "run a checkout's benchmarks (--quick: CI smoke run)"),
    "cluster": Command("router.cli.cluster", "run a local cluster on a workload and report"),
    "router": Command("router.cli.router", "run a cache-aware router (HTTP front, proxy, index)"),
    "replay": Command("router.cli.replay", "rebuild the index at a moment of an event log"),
    "explain": Command("router.cli.explain", "explain one routing decision from an event log"),
    "events": Command("events.cli.events", "dump an event log or tail live event streams"),
    "index": Command("router.cli.index", "check the Redis prefix index against workers, stats"),
    "keys": Command("events.cli.keys", "generate a CURVE key pair for authenticated event streams"),
    "record": Command("events.cli.record", "append workers' KV events to an event log"),
    "sim": Command("router.cli.sim", "replay a Mooncake trace over simulated workers, per policy"),
    "worker": Command("pool.worker.cli", "serve completions over a paged KV cache, publish events"),
}

_USAGE: Final = """usage: kvroute COMMAND [ARGS...]

kvroute: a distributed prefix cache with event streaming for LLM serving clusters.

commands:
{commands}

Run `kvroute COMMAND --help` for a command's flags; `kvroute --version` for the version.
"""


def _usage() -> str:
    width = max((len(name) for name in COMMANDS), default=0)
    lines = [f"  {name.ljust(width)}  {cmd.summary}" for name, cmd in sorted(COMMANDS.items())]
    return _USAGE.format(commands="\n".join(lines))


def version() -> str:
    """The installed kvroute's version, or a note that it runs from a bare source tree."""
    try:
        return importlib.metadata.version("kvroute")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: running from a source tree)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvroute``; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(f"kvroute: a command is required\n\n{_usage()}", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"kvroute {version()}")
        return 0
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"kvroute: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(command.module)
    return int(module.main(rest))


if __name__ == "__main__":
    sys.exit(main())
