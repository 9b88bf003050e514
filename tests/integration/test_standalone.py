"""A clone of this repository alone: both README commands run, on the built-in workload.

The clone is a copy of the checkout's packages in ``tmp_path`` with nothing beside it (no
``../shared``), run with ``PYTHONPATH`` pointing at it: exactly what a user who clones only
this repository has. Temporary directories are checked through ``TMPDIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from router.cluster.trace_generator import BUILTIN_TRACE_NAME
from tests.support.paths import REPO_ROOT as ROOT

pytestmark = pytest.mark.slow


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """The repository's packages (with the built C modules) alone in a fresh directory."""
    root = tmp_path / "clone" / "kvroute"
    for package in ("events", "pool", "router"):
        shutil.copytree(ROOT / package, root / package,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for name in ("README.md", "pyproject.toml"):
        shutil.copy(ROOT / name, root / name)
    assert not (root.parent.parent / "shared").exists()
    return root


def _env(clone: Path, tmp: Path) -> dict[str, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    return dict(os.environ, PYTHONPATH=str(clone), TMPDIR=str(tmp))


def _kvroute(
    clone: Path, tmp: Path, *argv: str, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router", *argv],
        cwd=clone,
        env=_env(clone, tmp),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_sim_runs_on_the_built_in_trace(clone: Path, tmp_path: Path) -> None:
    proc = _kvroute(clone, tmp_path / "tmp", "sim", "--limit", "400", "--json", timeout_s=240)
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith(f"kvroute sim: workload: {BUILTIN_TRACE_NAME} (no --trace given")
    report = json.loads(proc.stdout)
    assert (report["trace"], report["num_requests"]) == (BUILTIN_TRACE_NAME, 400)
    aware, rr = report["policies"]["cache_aware"], report["policies"]["round_robin"]
    assert aware["hit_rate_blocks"] > 2 * rr["hit_rate_blocks"] > 0


def test_cluster_quick_runs_on_the_built_in_trace_and_cleans_up(
    clone: Path, tmp_path: Path, redis_url: str
) -> None:
    tmp = tmp_path / "tmp"
    report = tmp_path / "report.json"
    proc = _kvroute(
        clone, tmp, "cluster", "--quick", "--redis", redis_url, "--json", str(report),
        "--plot", str(tmp_path / "cluster.png"), "--progress-interval-s", "0.5",
        timeout_s=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(f"kvroute cluster: workload: {BUILTIN_TRACE_NAME} (no --trace")
    data = json.loads(report.read_text())
    assert BUILTIN_TRACE_NAME in data["workload"]
    aware, rr = data["policies"]["cache_aware"], data["policies"]["round_robin"]
    assert aware["failed"] == rr["failed"] == 0
    assert aware["cached_tokens"] > rr["cached_tokens"]
    # stderr is a pipe, not a terminal: progress comes as periodic lines, not silence.
    assert any(" progress: cache_aware: " in line for line in lines), proc.stderr
    assert list(tmp.iterdir()) == []  # the process logs' temporary directory is gone


def test_a_failed_cluster_run_keeps_its_temporary_logs(
    clone: Path, tmp_path: Path, redis_url: str
) -> None:
    tmp = tmp_path / "tmp"
    proc = _kvroute(
        clone, tmp, "cluster", "--quick", "--redis", redis_url, "--no-plot", "--no-progress",
        "--worker-arg=--no-such-flag", timeout_s=180,
    )  # fmt: skip
    assert proc.returncode == 1
    kept = [p for p in tmp.iterdir() if p.name.startswith("kvroute-cluster-")]
    assert len(kept) == 1
    assert f"process logs kept in {kept[0]}" in proc.stderr
    assert "unrecognized arguments: --no-such-flag" in (kept[0] / "worker-0.log").read_text()


def test_an_unreachable_redis_is_reported_before_any_process_starts(
    clone: Path, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    proc = _kvroute(
        clone, tmp_path / "tmp", "cluster", "--quick", "--redis", "redis://127.0.0.1:1/0",
        "--no-plot", "--log-dir", str(logs), timeout_s=120,
    )  # fmt: skip
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "cannot reach Redis" in line]
    assert errors and errors[0].startswith(
        "kvroute cluster: cannot reach Redis at redis://127.0.0.1:1/0: "
    )
    assert errors[0].endswith("or leave out --redis to start a private one")
    assert not logs.exists() or list(logs.iterdir()) == []  # no worker was started
    assert "Traceback" not in proc.stderr
