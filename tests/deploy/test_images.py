"""The image definitions (``deploy/*.Dockerfile``) still build what the repository is.

They copy only what exists, install the repository with pip, start ``kvroute`` with a
command line kvroute's own parser takes, expose exactly the ports that command listens on,
and pin a CPU torch the worker extra accepts. Nothing is built here (no Docker): the
checks are static.
"""

from __future__ import annotations

import re
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support.deploy import DEPLOY, KvrouteCommand, dockerfile_instructions, exec_form
from tests.support.paths import REPO_ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

IMAGES = {"router": DEPLOY / "router.Dockerfile", "worker": DEPLOY / "worker.Dockerfile"}


def final_stage(role: str) -> list[tuple[str, str]]:
    """The instructions of an image's last stage (what runs)."""
    instructions = dockerfile_instructions(IMAGES[role])
    starts = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    return instructions[starts[-1] :]


@pytest.mark.parametrize("role", sorted(IMAGES))
def test_an_image_copies_only_what_the_repository_has_and_installs_it_with_pip(
    role: str,
) -> None:
    instructions = dockerfile_instructions(IMAGES[role])
    copied = [rest.split() for word, rest in instructions if word == "COPY"]
    sources = [src for words in copied if not words[0].startswith("--from") for src in words[:-1]]
    assert {"pyproject.toml", "events/", "pool/", "router/"} <= set(sources)
    for source in sources:
        assert (REPO_ROOT / source).exists(), f"{IMAGES[role].name} copies {source}"
    # Every package setuptools ships is copied (a new top-level package would be missed).
    packages = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pattern in packages["packages"]["find"]["include"]:
        assert pattern.rstrip("*") + "/" in sources, pattern
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert "pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ." in runs
    assert re.search(r"pip install --no-cache-dir \"\$\(ls /wheels/kvroute-\*\.whl\)\[", runs)


@pytest.mark.parametrize("role", sorted(IMAGES))
def test_an_image_runs_kvroute_as_a_user_with_a_command_it_parses_and_exposes_its_ports(
    role: str,
) -> None:
    stage = dict(final_stage(role))
    assert exec_form(stage["ENTRYPOINT"]) == ["kvroute"]
    assert stage["USER"] not in ("0", "root")
    command = KvrouteCommand.parse(exec_form(stage["CMD"]))
    assert command.role == role
    assert command.args.host == "0.0.0.0"  # a container's loopback is its own
    exposed = {int(p) for p in stage["EXPOSE"].split()}
    assert exposed == set(command.ports.values())


def test_the_worker_image_pins_a_cpu_torch_the_worker_extra_accepts() -> None:
    runs = [rest for word, rest in final_stage("worker") if word == "RUN"]
    (torch_line,) = [r for r in runs if "torch==" in r]
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_line
    match = re.search(r"torch==([0-9.]+)", torch_line)
    assert match is not None
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extra = [Requirement(r) for r in project["optional-dependencies"]["worker"]]
    (torch,) = [r for r in extra if r.name == "torch"]
    assert Version(match.group(1)) in torch.specifier
    # The CPU build is installed before the package, which then keeps it.
    assert runs.index(torch_line) < next(i for i, r in enumerate(runs) if "/wheels/" in r)
