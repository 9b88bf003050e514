"""The command line as a newcomer meets it: version, usage, flag spellings, help, hints."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from setuptools import find_packages

from events.cli.flags import add_flag, dest_of, help_text, renamed_dests
from router.cli.main import COMMANDS, main
from router.cli.router_config import config_from_args
from router.cli.router_flags import build_parser as router_parser
from router.store.server import RedisServer
from router.workers.registry import WorkerRecord
from tests.support.paths import REPO_ROOT as ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def test_version_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"kvroute \d+\.\d+\.\d+\S*\n", out), out
    # No command is a usage error (exit 2, usage on stderr), like a missing argument.
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvroute: a command is required\n\nusage: kvroute COMMAND")
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: kvroute COMMAND")


def test_kvroute_alone_as_a_process_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "router"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "usage: kvroute COMMAND" in proc.stderr


@pytest.mark.parametrize(
    ("canonical", "alias", "value", "dest", "attr"),
    [
        ("--lease-ttl-s", "--lease-ttl", "7.5", "lease_ttl_s", "lease_ttl_s"),
        ("--predicted-ttl-s", "--predicted-ttl", "12", "predicted_ttl_s", None),
        ("--route-hold-s", "--route-hold", "0.25", "route_hold_s", "route_hold_s"),
    ],
)
def test_router_time_flags_carry_their_unit_and_keep_the_old_spelling(
    canonical: str, alias: str, value: str, dest: str, attr: str | None
) -> None:
    parser = router_parser()
    new = parser.parse_args([canonical, value])
    old = parser.parse_args([alias, value])
    assert getattr(new, dest) == getattr(old, dest) == float(value)
    assert not hasattr(old, dest_of(alias)) or dest_of(alias) == dest
    config = config_from_args(old, "redis://x")
    got = config.policy_config.predicted_ttl_s if attr is None else getattr(config, attr)
    assert got == float(value)
    text = parser.format_help()
    assert canonical in text
    assert re.search(rf"{re.escape(alias)}\b(?!-s)", text) is None  # hidden


def test_old_config_file_keys_still_work(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"lease_ttl": 4.0, "route_hold": 0.5, "predicted_ttl": 9.0}))
    config = config_from_args(router_parser().parse_args(["--config", str(old)]), "redis://x")
    assert (config.lease_ttl_s, config.route_hold_s) == (4.0, 0.5)
    assert config.policy_config.predicted_ttl_s == 9.0


@pytest.mark.slow
def test_benchmark_duration_flags_carry_their_unit() -> None:
    bench_throughput = importlib.import_module("benchmarks.bench_throughput")
    bench_soak = importlib.import_module("benchmarks.bench_soak")
    for module, canonical, alias in (
        (bench_throughput, "--duration-s", "--seconds"),
        (bench_soak, "--duration-min", "--minutes"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", module.__name__, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert canonical in proc.stdout and alias not in proc.stdout


def test_the_flag_mechanism_shows_the_default_once_and_hides_aliases() -> None:
    parser = argparse.ArgumentParser()
    add_flag(parser, "--wait-s", aliases=("--wait",), type=float, default=2.0, meaning="a wait")
    add_flag(parser, "--key", meaning="a key file", default_text="none, 100% open", env="K")
    assert parser.parse_args([]).wait_s == 2.0
    assert parser.parse_args(["--wait", "3"]).wait_s == 3.0
    assert parser.parse_args(["--wait-s", "4"]).wait_s == 4.0
    text = parser.format_help()
    assert "a wait (default: 2.0)" in text
    assert "a key file (default: none, 100% open; env $K)" in " ".join(text.split())
    assert "--wait " not in text and "--wait\n" not in text
    assert help_text("x") == "x"
    assert renamed_dests({"--a-s": ("--a", "--aa")}) == {"a": "a_s", "aa": "a_s"}


def _option_helps(text: str) -> list[str]:
    """Each option's help text in an argparse ``--help`` (joined over its lines)."""
    blocks: list[str] = []
    for line in text.splitlines():
        if re.match(r"^  -", line):
            blocks.append(line)
        elif blocks and line.startswith("    "):
            blocks[-1] += " " + line.strip()
        elif not line.strip():
            blocks.append("")
    return [" ".join(b.split()) for b in blocks if b]


_COMMANDS_WITH_FLAGS = (
    "worker", "router", "cluster", "sim", "record", "events tail", "replay", "explain",
    "index stats", "bench",
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("argv", [c.split() for c in _COMMANDS_WITH_FLAGS])
def test_help_states_each_default_once_in_one_form(argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "router", *argv, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for option in _option_helps(proc.stdout):
        assert option.count("(default") <= 1, option
        assert "default)" not in option.replace("'end' (default)", ""), option
        assert re.search(r"\(default [^:]", option) is None, option  # "(default: X)" only


def test_a_missing_trace_hint_names_only_flags_the_command_has(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = str(tmp_path / "missing.jsonl")
    assert main(["sim", "--trace", missing]) == 1
    message = next(r.getMessage() for r in caplog.records if "cannot read trace" in r.getMessage())
    from router.cli.sim import _parser as sim_parser

    known = {s for a in sim_parser()._actions for s in a.option_strings}
    named = set(re.findall(r"--[a-z][a-z-]*", message))
    assert named and named <= known, (named - known, message)
    assert "--workload" not in message


def test_index_stats_lists_the_namespaces_it_finds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with RedisServer() as server:  # a server of this test alone: it holds only these
        for ns in ("prod", "staging"):
            argv = ["index", "register", "--redis", server.url, "--namespace", ns]
            assert main([*argv, "--worker", f"w-{ns}=tcp://127.0.0.1:9"]) == 0
        capsys.readouterr()
        assert main(["index", "stats", "--redis", server.url]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == (
            f"2 namespace(s) on {server.url}; --namespace NS for one namespace's details"
        )
        assert [line.split() for line in lines[1:]] == [
            ["namespace", "entries", "keys", "workers"],
            ["prod", "0", "0", "0"],
            ["staging", "0", "0", "0"],
        ]
        assert main(["index", "stats", "--redis", server.url, "--json"]) == 0
        assert set(json.loads(capsys.readouterr().out)["namespaces"]) == {"prod", "staging"}
        # One (empty) namespace: the per-entry line says why it has no figure.
        assert main(["index", "stats", "--redis", server.url, "--namespace", "prod"]) == 0
        out = capsys.readouterr().out
        assert "memory/entry   n/a (no entries)" in out.splitlines()
    with RedisServer() as empty:
        assert main(["index", "stats", "--redis", empty.url]) == 0
        assert capsys.readouterr().out.startswith("no kvroute namespace on ")
    assert WorkerRecord  # registrations above go through the real registry


def test_benchmarks_are_not_installed_but_kvroute_bench_finds_the_checkout(
    tmp_path: Path,
) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(where=str(ROOT), include=include)
    assert "router" in packages and "pool.worker" in packages
    assert not [p for p in packages if p.split(".")[0] in ("benchmarks", "tests", "docs")]
    # From outside the checkout, `kvroute bench` still finds the checkout's benchmarks.
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from router.cli.main import main; "
         "sys.exit(main(['bench', '--list']))"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "bench_sim" in proc.stdout.split()


def test_kvroute_bench_without_a_checkout_says_so(tmp_path: Path) -> None:
    # An installed kvroute: the packages without benchmarks/ beside them.
    for package in ("events", "router"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from router.cli.main import main; "
         "sys.exit(main(['bench', '--list']))"],
        cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "the benchmarks are not installed with kvroute; they run from a source checkout" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_every_command_is_listed() -> None:
    assert COMMANDS["bench"].module == "router.cli.bench"
