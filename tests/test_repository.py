"""The repository stands on its own: nothing it ships depends on a file beside it.

Code, comments, tests, benchmarks and docs cite only files inside the repository, and no
tracker numbers; the one thing that may sit beside a checkout is the optional Mooncake
trace under ``../shared/data/``. Every ``docs/`` page the README names exists. Test
modules share helpers through ``tests/support/`` only, never by importing one another.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator
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


_IMPORT = re.compile(r"^[ \t]*(?:import|from)[ \t][^\n]*", re.MULTILINE)


def _imports(text: str) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of each import statement (``.x`` for a relative one).

    Statements are found by their first word, then parsed with ast (a parenthesized one
    runs to its closing parenthesis); parsing whole modules would cost the fast tier a
    second."""
    for match in _IMPORT.finditer(text):
        end = text.index(")", match.start()) + 1 if "(" in match.group() else match.end()
        try:
            statement = ast.parse(textwrap.dedent(text[match.start() : end])).body[0]
        except SyntaxError:
            continue  # a line of prose that starts with "from" or "import"
        line = text.count("\n", 0, match.start()) + 1
        if isinstance(statement, ast.Import):
            yield from ((line, alias.name) for alias in statement.names)
        elif isinstance(statement, ast.ImportFrom):
            yield line, "." * statement.level + (statement.module or "")


def test_no_test_module_imports_another_test_module() -> None:
    """Shared helpers live in ``tests.support``; a test module or conftest imported by name
    (``tests.router...``, or bare through pytest's sys.path entries) is refused."""
    tests = ROOT / "tests"
    support = tests / "support"
    modules = sorted(tests.rglob("*.py"))
    local = {p.stem for p in modules if support not in p.parents}
    found = []
    for path in modules:
        for line, name in _imports(path.read_text()):
            top, shared = name.split(".")[0], f"{name}.".startswith("tests.support.")
            if name.startswith(".") or top in local or (top == "tests" and not shared):
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {name}")
    assert found == []
