"""Each package's public API: a sorted ``__all__`` of importable names, no torch needed."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import typing

import pytest

PACKAGES = ["events", "pool", "router"]


def isort_key(name: str) -> tuple[int, list[int | str]]:
    """The order ruff's RUF022 keeps: CONSTANTS, then Classes, then functions; natural sort."""
    category = 0 if len(name) > 1 and name.isupper() else 1 if name[:1].isupper() else 2
    parts: list[int | str] = [
        int(part) if index % 2 else part for index, part in enumerate(re.split(r"(\d+)", name))
    ]
    return category, parts


def test_isort_key_orders_like_ruff() -> None:
    names = ["wire_hash", "BlockPool", "MEDIUM_GPU", "Block10", "Block9", "T", "abc"]
    assert sorted(names, key=isort_key) == [
        "MEDIUM_GPU",
        "Block9",
        "Block10",
        "BlockPool",
        "T",
        "abc",
        "wire_hash",
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_sorted_unique_and_importable(package: str) -> None:
    module = importlib.import_module(package)
    names = list(module.__all__)
    assert names, f"{package}.__all__ is empty"
    assert names == sorted(names, key=isort_key), f"{package}.__all__ is not sorted"
    assert len(set(names)) == len(names), f"{package}.__all__ has duplicates"
    missing = [name for name in names if not hasattr(module, name)]
    assert missing == [], f"{package}.__all__ names what it does not define"


def test_events_and_router_import_without_torch() -> None:
    code = "import sys, events, router; sys.exit(int('torch' in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_documented(package: str) -> None:
    module = importlib.import_module(package)
    # Constants and type aliases carry no docstring of their own: they are documented by
    # the string literal that follows them where they are defined.
    undocumented = [
        name
        for name in module.__all__
        if not name.isupper()
        and typing.get_origin(getattr(module, name)) is None
        and not (getattr(module, name).__doc__ or "").strip()
    ]
    assert undocumented == [], f"{package}: public names without a docstring: {undocumented}"


def test_importing_router_loads_its_public_names_lazily() -> None:
    code = (
        "import sys, router; assert 'aiohttp' not in sys.modules, 'aiohttp'; "
        "router.RouterService; assert 'aiohttp' in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
