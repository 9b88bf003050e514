"""Smoke runs of the examples, as a user runs them (a subprocess each, real processes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from router.cli.main import COMMANDS
from tests.support.paths import REPO_ROOT as ROOT


def run_example(name: str, *args: str, tmp: Path, timeout_s: float = 240.0) -> str:
    """Run an example; its temporary files go under ``tmp`` (TMPDIR), which it must empty."""
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert list(tmp.iterdir()) == [], f"{name} left temporary files behind"
    return proc.stdout


@pytest.mark.slow
def test_replay_debugging_example_without_keep_leaves_nothing(tmp_path: Path) -> None:
    out = run_example("replay_debugging.py", tmp=tmp_path)
    assert "the second question went to" in out


@pytest.mark.slow
def test_replay_debugging_example(tmp_path: Path) -> None:
    out = run_example("replay_debugging.py", "--keep", str(tmp_path), tmp=tmp_path / "tmp")
    # The router sends the second question after the worker that cached the system prompt.
    match = re.search(r"the second question went to (w\d) \(224 cached prompt tokens\); "
                      r"the first went to (w\d)", out)  # fmt: skip
    assert match is not None, out
    holder = match.group(1)
    assert match.group(2) == holder
    before, after = out.split("$ kvroute replay", 2)[1:]
    explained = before.split("$ kvroute explain")[1]
    row = next(line for line in explained.splitlines() if line.startswith(f"{holder} "))
    assert row.split()[:6] == [holder, "224", "224", "0", "0", "0"]
    assert row.endswith("<- picked")
    assert "the replayed state agrees." in explained
    # After the holder's prefix cache reset, the index holds nothing of the system prompt;
    # the router's predicted entry of the recorded decision still credits the holder.
    replayed = next(line for line in after.splitlines() if line.startswith(f"{holder} "))
    assert replayed.split()[-1] == "0"  # entries (batch counts vary with the handshake)
    explained_after = after.split("$ kvroute explain")[1]
    row = next(line for line in explained_after.splitlines() if line.startswith(f"{holder} "))
    assert row.split()[:3] == [holder, "0", "224"]  # matched 0, credited 224
    assert f"disagrees: {holder}: the router matched 224 tokens, the replayed index 0" in after
    assert (tmp_path / "events.kvlog").exists()


@pytest.mark.slow
@pytest.mark.skipif("router" not in COMMANDS, reason="`kvroute router` is not registered yet")
def test_local_cluster_example(tmp_path: Path) -> None:
    out = run_example("local_cluster.py", "--workers", "2", "--requests", "12", tmp=tmp_path)
    lines = out.splitlines()
    hit = next(line for line in lines if line.startswith("prefix hit rate"))
    assert hit.split()[-1].endswith("x")
    assert "cache_aware served" in lines[-1]
