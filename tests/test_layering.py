"""The packages' dependency order, read from every module's imports (lazy ones included).

``router``'s folders form one order: a folder imports only those to its left (its own
modules and ``router.errors`` and ``router.tasks``, the shared leaves, are always fine);
``router/__init__.py`` (the lazy public API), ``router/cli`` and the ``__main__`` shells
(``python -m router``, ``python -m router.sim``: the command line) are the top. The
I/O-free pool core (``pool/*.py``) never imports the worker process (``pool.worker``),
and ``events``, the leaf, imports neither ``pool`` nor ``router``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from tests.support.paths import REPO_ROOT

ROUTER_ORDER: Final = (
    "store",
    "index",
    "workers",
    "load",
    "routing",
    "ingest",
    "front",
    "offline",
    "cluster",
    "sim",
    "cli",
)
"""``router``'s folders, each importing only those before it."""

ROUTER_LEAVES: Final = frozenset({"errors", "tasks"})
"""What any folder of ``router`` may import."""

DYNAMIC_IMPORTERS: Final = frozenset({"import_module", "native", "native_or"})
"""Calls whose string arguments name a module they import (``importlib.import_module``,
``events.native``'s C module lookups)."""

PACKAGES: Final = ("events", "pool", "router")


def module_name(path: Path) -> str:
    """The dotted name of a module file of the repository (a package's ``__init__`` kept)."""
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)


def imported_modules(name: str, source: str) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` of every module that module ``name`` (whose text is
    ``source``) imports, anywhere in the file; ``from a import b`` yields ``a.b`` (``b``
    may be a module), and a call of :data:`DYNAMIC_IMPORTERS` each string argument that
    names a module of :data:`PACKAGES`."""
    package = name.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in DYNAMIC_IMPORTERS:
                for arg in node.args:
                    value = arg.value if isinstance(arg, ast.Constant) else None
                    if isinstance(value, str) and value.split(".")[0] in PACKAGES:
                        yield node.lineno, value
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = ".".join(package[: len(package) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """:func:`imported_modules` of a module file."""
    return imported_modules(module_name(path), path.read_text(encoding="utf-8"))


def router_folder(name: str) -> str | None:
    """The folder of ``router`` that a module (or the name it imports) belongs to; None
    for the package's face (``router``, ``router.__init__``, ``router.__main__``)."""
    parts = name.split(".")
    if len(parts) < 2 or parts[1] in ("__init__", "__main__"):
        return None
    return parts[1]


def router_violations(name: str, source: str) -> list[str]:
    """The imports of ``router`` folders that module ``name`` may not make."""
    folder = router_folder(name)
    if folder is None or folder == "cli" or name.endswith(".__main__"):
        return []  # the top imports anything
    assert folder in ROUTER_ORDER or folder in ROUTER_LEAVES, (
        f"router/{folder} is in no layer: add it to ROUTER_ORDER (or ROUTER_LEAVES)"
    )
    rank = ROUTER_ORDER.index(folder) if folder in ROUTER_ORDER else -1
    out = []
    for line, target in imported_modules(name, source):
        if target.split(".")[0] != "router":
            continue
        other = router_folder(target)
        if other == folder or other in ROUTER_LEAVES:
            continue
        if other is None or other not in ROUTER_ORDER or ROUTER_ORDER.index(other) > rank:
            out.append(f"{name}:{line} imports {target}")
    return out


def files(package: str) -> list[Path]:
    """Every Python module of a top-level package, sorted."""
    return sorted((REPO_ROOT / package).rglob("*.py"))


def test_every_router_folder_has_a_layer() -> None:
    folders = {p.name for p in (REPO_ROOT / "router").iterdir() if (p / "__init__.py").exists()}
    assert set(ROUTER_ORDER) <= folders <= set(ROUTER_ORDER) | ROUTER_LEAVES


@pytest.mark.parametrize("path", files("router"), ids=module_name)
def test_router_folders_import_only_those_to_their_left(path: Path) -> None:
    assert router_violations(module_name(path), path.read_text(encoding="utf-8")) == []


def test_pool_core_does_not_import_the_worker_process() -> None:
    core = sorted((REPO_ROOT / "pool").glob("*.py"))
    assert core, "no pool core modules found"
    found = [
        f"{module_name(path)}:{line} imports {name}"
        for path in core
        for line, name in imports_of(path)
        if name == "pool.worker" or name.startswith("pool.worker.")
    ]
    assert found == []


def test_events_imports_neither_pool_nor_router() -> None:
    found = [
        f"{module_name(path)}:{line} imports {name}"
        for path in files("events")
        for line, name in imports_of(path)
        if name.split(".")[0] in ("pool", "router")
    ]
    assert found == []


def test_the_check_finds_lazy_relative_and_upward_imports() -> None:
    source = (
        "from router.errors import RouterError\n"
        "from router.tasks.periodic import Periodic\n"
        "from . import layout\n"
        "from ..index import base\n"
        "from ..front import app\n"
        "import router\n"
        "def late() -> None:\n"
        "    from router.ingest import bridge\n"
        "pack = native('router.store._resp', 'pack_args')\n"
        "runs = native_or(len, 'router.ingest._native._runs', 'store_run')\n"
    )
    assert sorted(router_violations("router.workers.probe", source)) == [
        "router.workers.probe:10 imports router.ingest._native._runs",
        "router.workers.probe:5 imports router.front.app",
        "router.workers.probe:6 imports router",
        "router.workers.probe:8 imports router.ingest.bridge",
    ]
    assert router_violations("router.cli.probe", source) == []
    assert router_violations("router.workers.__main__", source) == []
    assert router_violations("router.__init__", source) == []
