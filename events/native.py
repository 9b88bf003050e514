"""kvroute's optional C modules: the C function where it was built, else its Python reference.

The ingest's hot path has C versions (``events._keys``, ``router.ingest._native._runs``), built at
install time where a C compiler is present. Each has a Python reference with the same
signature and behaviour that the tests compare it with; :func:`native_or` picks one when its
module is imported. What has no Python twin (a faster way to do something the caller can
also do otherwise) is found with :func:`native`. ``KVROUTE_PURE_PYTHON=1`` picks the
references everywhere: to rule the C code out while debugging, or to measure what it saves.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any, Final, TypeVar, cast

__all__ = ["PURE_PYTHON", "native", "native_or"]

PURE_PYTHON: Final = os.environ.get("KVROUTE_PURE_PYTHON", "") not in ("", "0")
"""Whether ``KVROUTE_PURE_PYTHON`` asks for the Python references."""

F = TypeVar("F", bound=Callable[..., Any])


def native(module: str, name: str) -> Any | None:
    """``module.name`` where that C module was built (and :data:`PURE_PYTHON` is off),
    else None."""
    if PURE_PYTHON:
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:  # built without a C compiler
        return None


def native_or(reference: F, module: str, name: str) -> F:
    """``module.name`` where that C module was built (and :data:`PURE_PYTHON` is off),
    else ``reference``; the two must agree on every input, errors included."""
    found = native(module, name)
    return reference if found is None else cast("F", found)
