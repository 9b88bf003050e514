"""``kvroute bench``: run the benchmarks of the source checkout this kvroute comes from.

The benchmarks live in ``benchmarks/`` at the top of a checkout and are not installed
with the package (a wheel carries no top-level ``benchmarks``). This command finds them
beside the ``router`` package it runs from, as in a clone with an editable install, and
runs ``python -m benchmarks`` there; an installation without a checkout says so and
exits 2.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Final

__all__ = ["checkout_root", "main"]

_ROOT: Final = Path(__file__).resolve().parents[2]


def checkout_root() -> Path | None:
    """The source checkout holding ``benchmarks/``, or ``None`` for an installed kvroute."""
    return _ROOT if (_ROOT / "benchmarks" / "__main__.py").is_file() else None


def main(argv: list[str]) -> int:
    """Run ``kvroute bench``; returns the benchmarks' exit code, 2 without a checkout."""
    root = checkout_root()
    if root is None:
        print(
            "kvroute bench: the benchmarks are not installed with kvroute; they run from a "
            f"source checkout (no benchmarks/ in {_ROOT}): clone the repository and run "
            "`kvroute bench` or `python -m benchmarks` from an editable install there",
            file=sys.stderr,
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module("benchmarks.__main__")
    return int(module.main(argv))
