"""The repository stands on its own: nothing it ships depends on a file beside it.

Code, comments, tests, benchmarks and docs cite only files inside the repository, and no
tracker numbers; the one thing that may sit beside a checkout is the optional Mooncake
trace under ``../shared/data/``. Every ``docs/`` page the README names exists. Test
modules share helpers through ``tests/support/`` only, never by importing one another.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.paths import REPO_ROOT as ROOT

_SOURCES = ("events", "pool", "router", "benchmarks", "tests", "examples", "docs")
_OUTSIDE_NOTES = re.compile(r"VLLM_WIRE\.md|DESIGN\.md|STYLE\.md")
_SHARED_NOT_DATA = re.compile(r"\.\./shared/(?!data/)")
_TRACKER = re.compile(r"\b(?:issue|pull request|PR)\s*#?\d+|(?<![\w&])#\d{2,}\b", re.IGNORECASE)


def _texts() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for top in _SOURCES:
        files += [
            p
            for p in (ROOT / top).rglob("*")
            if p.suffix in (".py", ".md", ".toml", ".c", ".h") and "__pycache__" not in p.parts
        ]
    return files


def test_nothing_cites_a_file_outside_the_repository_or_a_tracker_number() -> None:
    me = Path(__file__).resolve()
    found = []
    for path in _texts():
        if path.resolve() == me:
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern in (_OUTSIDE_NOTES, _SHARED_NOT_DATA, _TRACKER):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert found == []


def test_the_docs_the_readme_names_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`(docs/[\w.-]+\.md)`", readme))
    assert {"docs/architecture.md", "docs/workload.md", "docs/simulator.md"} <= named
    for page in named:
        assert (ROOT / page).is_file(), page
    for page in (ROOT / "docs").glob("*.md"):
        for other in re.findall(r"`(docs/[\w.-]+\.md)`", page.read_text()):
            assert (ROOT / other).is_file(), f"{page.name} names {other}"


def test_no_test_module_imports_another_test_module() -> None:
    """Shared helpers live in ``tests.support``; a test module or conftest imported by name
    (``tests.router...``, or bare through pytest's sys.path entries) is refused."""
    tests = ROOT / "tests"
    support = tests / "support"
    modules = sorted(tests.rglob("*.py"))
    local = {p.stem for p in modules if support not in p.parents}
    found = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            else:
                continue
            for name in names:
                top, shared = name.split(".")[0], f"{name}.".startswith("tests.support.")
                if name.startswith(".") or top in local or (top == "tests" and not shared):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}")
    assert found == []
