"""Which event loop a serving process runs on: uvloop where installed, else asyncio's own.

uvloop (libuv) is optional (``pip install 'kvroute[fast]'``); the alternatives were
measured in ``benchmarks/RESULTS.md`` (bench_router, bench_throughput: "server stack").
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

from router.errors import RouterError

__all__ = ["EVENT_LOOPS", "run_on"]

EVENT_LOOPS: Final = ("auto", "asyncio", "uvloop")
"""``--event-loop`` choices: ``auto`` is uvloop when installed, else asyncio."""

T = TypeVar("T")


def run_on(loop: str, main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh event loop of the kind named.

    Raises:
        RouterError: ``uvloop`` is asked for and not installed (``main`` is closed).
    """
    has_uvloop = importlib.util.find_spec("uvloop") is not None
    if loop == "uvloop" and not has_uvloop:
        main.close()
        raise RouterError(
            "--event-loop uvloop: uvloop is not installed (pip install 'kvroute[fast]')"
        )
    if loop != "asyncio" and has_uvloop:
        # Imported by name: type checks pass whether the optional extra is installed or not.
        uvloop = importlib.import_module("uvloop")
        result: T = uvloop.run(main)
        return result
    return asyncio.run(main)
