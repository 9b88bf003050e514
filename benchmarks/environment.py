"""The one-line description of the machine and software a benchmark ran on, for its report."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata

from events.hashing import NATIVE_KEYS
from events.schema import NATIVE_DECODE
from router.ingest._native.runs import NATIVE_RUNS

__all__ = ["describe", "native_text"]


def native_text() -> str:
    """Whether kvroute's C modules ran (``KVROUTE_PURE_PYTHON=1`` or no compiler: off)."""
    return f"C modules {'on' if NATIVE_KEYS and NATIVE_RUNS and NATIVE_DECODE else 'off'}"


def describe(
    libraries: Sequence[str] = (), *, redis_server: str | None = None, extra: str = ""
) -> str:
    """CPython version, machine, CPU count, the given distributions' versions, the Redis
    server's version (``redis_server``: its binary) and ``extra``, comma-separated."""
    parts = [f"CPython {platform.python_version()}", platform.machine(), f"{os.cpu_count()} CPUs"]
    for name in libraries:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} (not installed)")
    if redis_server is not None:
        out = subprocess.run([redis_server, "--version"], capture_output=True, text=True).stdout
        parts.append(out.split(" sha=")[0].strip())
    if extra:
        parts.append(extra)
    return ", ".join(parts)
