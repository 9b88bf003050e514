"""A normal start is quiet; a missing Redis is one clear error.

A router starting cold in front of a fresh worker takes the worker's first lease and loads
its snapshot: nothing was lost, so nothing deserves a WARNING, and the Redis connection is
announced once. A router whose Redis does not answer exits non-zero with one message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from router.cluster.processes import ProcessGroup
from router.store.server import free_port
from tests.support.faults import WORKER_ARGS, python_m
from tests.support.paths import REPO_ROOT as ROOT
from tests.support.polling import wait_until

pytestmark = pytest.mark.slow
_TIMEOUT_S = 120.0


def _wait_for_line(log: Path, text: str, group: ProcessGroup) -> None:
    def logged() -> bool:
        if text in (log.read_text(errors="replace") if log.exists() else ""):
            return True
        group.check_alive()
        return False

    wait_until(logged, f"{log.name} to log {text!r}", timeout_s=_TIMEOUT_S)


def test_a_cold_start_logs_no_warning(tmp_path: Path, redis_url: str, namespace: str) -> None:
    http, events, replay, port = free_port(), free_port(), free_port(), free_port()
    with ProcessGroup(tmp_path) as group:
        group.start("worker", python_m(
            "worker", "--id", "w0", "--port", str(http), "--num-blocks", "64",
            "--events", f"tcp://127.0.0.1:{events}", "--replay", f"tcp://127.0.0.1:{replay}",
            "--torch-threads", "1", *WORKER_ARGS,
        ))  # fmt: skip
        _wait_for_line(tmp_path / "worker.log", "worker ready", group)
        spec = f"w0=http://127.0.0.1:{http},events=tcp://127.0.0.1:{events}," \
               f"replay=tcp://127.0.0.1:{replay}"  # fmt: skip
        group.start("router", python_m(
            "router", "--redis", redis_url, "--namespace", namespace, "--port", str(port),
            "--worker", spec,
        ))  # fmt: skip
        # The cold start is done once the worker's first lease loaded its (empty) snapshot.
        _wait_for_line(tmp_path / "router.log", "loaded snapshot of 0 runs", group)
        _wait_for_line(tmp_path / "router.log", "router listening on", group)
    router_log = (tmp_path / "router.log").read_text()
    worker_log = (tmp_path / "worker.log").read_text()
    for name, log in (("router", router_log), ("worker", worker_log)):
        warnings = [line for line in log.splitlines() if " WARNING " in line]
        assert warnings == [], f"{name}: {warnings}"
    assert router_log.count("connected to Redis") == 1
    assert "worker w0: first lease, loading its entries (rebuild)" in router_log


def test_a_router_without_its_redis_exits_with_one_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "router", "router", "--redis", "redis://127.0.0.1:1/0",
         "--port", "0"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stdout == ""  # no ready line
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1
    assert "router failed: cannot reach Redis at redis://127.0.0.1:1/0: " in errors[0]
    assert "Traceback" not in proc.stderr
