"""``kvroute cluster --quick`` end to end: Redis, real workers, a real router, a real report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from router.cli.cluster import build_parser, build_workload, workload_source
from router.cli.main import COMMANDS
from tests.support.paths import REPO_ROOT as ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("router" not in COMMANDS, reason="`kvroute router` is not registered yet"),
]


def _kvroute(*args: str) -> list[str]:
    return [sys.executable, "-m", "router", *args]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def _children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command (which is in parentheses and may hold spaces).
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def test_quick_cluster_reports_cache_aware_beating_round_robin(
    tmp_path: Path, redis_url: str
) -> None:
    report = tmp_path / "report.json"
    plot = tmp_path / "cluster.png"
    record = tmp_path / "record"
    argv = _kvroute(
        "cluster", "--quick", "--redis", redis_url, "--json", str(report),
        "--plot", str(plot), "--log-dir", str(tmp_path / "logs"), "--no-progress",
        "--record", str(record),
    )  # fmt: skip
    proc = subprocess.run(
        argv,
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    aware, rr = data["policies"]["cache_aware"], data["policies"]["round_robin"]
    assert aware["requests"] == rr["requests"] == data["num_requests"] == 40
    assert aware["failed"] == rr["failed"] == 0
    assert aware["prompt_tokens"] == rr["prompt_tokens"]
    # Cold caches both times; the cache-aware router reuses more of every prefix.
    assert aware["cached_tokens"] > rr["cached_tokens"]
    assert aware["hit_rate"] <= data["ideal_hit_rate"]
    assert 0 < data["pooled_lru_hit_rate"] <= data["ideal_hit_rate"]
    assert aware["ratio_to_pooled_lru"] == aware["hit_rate"] / data["pooled_lru_hit_rate"]
    for run in (aware, rr):
        served = run["workers"]
        assert len(served) == 2
        assert sum(w["requests"] for w in served.values()) == 40
        assert sum(w["cached_tokens"] for w in served.values()) == run["cached_tokens"]
    assert "cache_aware/round_robin" in proc.stdout
    assert plot.read_bytes()[:4] == b"\x89PNG"
    _check_recording(record, tmp_path)


def _check_recording(record: Path, tmp_path: Path) -> None:
    """The recorded runs replay cleanly and explain finds the router's decisions."""
    for policy in ("cache_aware", "round_robin"):
        log, decisions = record / f"{policy}.kvlog", record / f"{policy}.decisions.jsonl"
        replayed = subprocess.run(
            _kvroute("replay", str(log), "--json"), env=_env(), capture_output=True, text=True
        )
        assert replayed.returncode == 0, replayed.stderr
        workers = json.loads(replayed.stdout)["workers"]
        assert sorted(workers) == ["worker-0", "worker-1"]
        for figures in workers.values():
            assert (figures["orphans"], figures["resyncs"], figures["resets"]) == (0, 0, 0)
            assert figures["entries"] > 0
        lines = decisions.read_text().splitlines()
        assert len(lines) == 40
        last = json.loads(lines[-1])
        assert last["policy"] == policy
        args = build_parser().parse_args(["--quick"])
        workload = build_workload(args, workload_source(args))
        # The last decision's request: the prompt of its length (the log holds no prompts).
        prompt = next(
            r.token_ids for r in workload.requests if len(r.token_ids) == last["num_prompt_tokens"]
        )
        tokens = tmp_path / "last_prompt.json"
        tokens.write_text(json.dumps(list(prompt)))
        argv = ["explain", str(log), "--at", repr(last["ts"]), "--tokens", str(tokens),
                "--decisions", str(decisions), "--json"]  # fmt: skip
        explained = subprocess.run(_kvroute(*argv), env=_env(), capture_output=True, text=True)
        assert explained.returncode == 0, explained.stderr
        found = json.loads(explained.stdout)["router"]
        assert (found["worker_id"], found["policy"]) == (last["worker_id"], policy)


def test_ctrl_c_stops_every_process_it_started(tmp_path: Path, redis_url: str) -> None:
    argv = _kvroute(
        "cluster", "--quick", "--redis", redis_url, "--no-plot", "--no-progress",
        "--log-dir", str(tmp_path / "logs"),
    )  # fmt: skip
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Wait until the workers are up (their logs exist and children run), then interrupt.
        deadline = time.monotonic() + 120
        while len(_children_of(proc.pid)) < 2:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the cluster never started its workers"
            time.sleep(0.1)  # polling /proc for the children of a process we started
        children = _children_of(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid), f"{pid} survived"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_worker_that_cannot_start_is_reported_with_its_log(
    tmp_path: Path, redis_url: str
) -> None:
    argv = _kvroute(
        "cluster", "--quick", "--redis", redis_url, "--no-plot", "--no-progress",
        "--log-dir", str(tmp_path / "logs"), "--worker-arg=--no-such-flag",
    )  # fmt: skip
    proc = subprocess.run(
        argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert "exited with code 2; last lines of its log" in proc.stderr
    assert "unrecognized arguments: --no-such-flag" in proc.stderr
    assert str(tmp_path / "logs") in proc.stderr
