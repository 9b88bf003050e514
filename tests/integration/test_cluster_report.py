"""The cluster's pieces that need no workers: figures, report text, plot, process group."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from router.cli.cluster import build_parser, build_workload, workload_source
from router.cluster.processes import ProcessError, ProcessGroup
from router.cluster.report import (
    ClusterReport,
    PolicyRun,
    RequestResult,
    WorkerStats,
    format_report,
    percentile,
    write_plot,
)
from router.cluster.runner import ClusterConfig, ClusterError
from router.cluster.trace_generator import BUILTIN_TRACE_NAME
from router.cluster.workload import Workload, WorkloadError
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.slow


def _run(policy: str, cached: list[int], served: list[tuple[int, int, int]]) -> PolicyRun:
    results = tuple(
        RequestResult(prompt_tokens=100, cached_tokens=c, output_tokens=2, ttft_s=0.01 * (i + 1))
        for i, c in enumerate(cached)
    )
    workers = tuple(WorkerStats(f"worker-{i}", *s) for i, s in enumerate(served))
    return PolicyRun(policy, workers, results, wall_s=2.0)


def _report() -> ClusterReport:
    aware = _run("cache_aware", [0, 96, 96, 48], [(2, 200, 96), (2, 200, 144)])
    rr = _run("round_robin", [0, 0, 48, 0], [(3, 300, 48), (1, 100, 0)])
    return ClusterReport("4 test requests", 4, 0.75, (aware, rr))


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([float(i) for i in range(1, 101)], 100) == 100.0
    assert percentile([5.0], 99) == 5.0


def test_policy_run_figures() -> None:
    run = _report().runs[0]
    assert run.cached_tokens == 240
    assert run.prompt_tokens == 400
    assert run.hit_rate == 0.6
    assert run.ttft_p50_s == 0.02
    assert run.ttft_p99_s == 0.04
    assert run.throughput_rps == 2.0
    assert run.requests_per_worker == {"worker-0": 2, "worker-1": 2}
    assert run.load_imbalance == 1.0
    # Computed tokens 104 and 56: max / mean = 104 / 80.
    assert run.prefill_imbalance == 1.3
    failed = PolicyRun("x", (), (RequestResult(10, error="HTTP 503"),), wall_s=1.0)
    assert failed.num_failed == 1
    assert failed.hit_rate == 0.0
    assert failed.throughput_rps == 0.0


def test_report_text_has_every_figure_and_the_ratio_to_the_baseline() -> None:
    text = format_report(_report())
    lines = text.splitlines()
    assert lines[0] == "workload: 4 test requests"
    assert "(the bound): 75.0 %" in lines[1]
    header = next(line for line in lines if "cache_aware/round_robin" in line)
    assert header.split() == ["cache_aware", "round_robin", "cache_aware/round_robin"]
    hit = next(line for line in lines if line.startswith("prefix hit rate"))
    assert hit.split()[-5:] == ["60.0", "%", "12.0", "%", "5.00x"]
    cached = next(line for line in lines if line.startswith("cached tokens"))
    assert cached.split()[-3:] == ["240", "48", "5.00x"]
    load = next(line for line in lines if line.startswith("load max/mean (requests)"))
    assert load.split()[-3:] == ["1.00", "1.50", "0.67x"]
    assert lines[-2].split() == ["worker-0", "2", "3"]
    assert lines[-1].split() == ["worker-1", "2", "1"]


def test_report_shows_the_pooled_lru_bound_and_each_policys_ratio_to_it() -> None:
    base = _report()
    report = ClusterReport(base.workload, base.num_requests, 0.75, base.runs, 0.5)
    lines = format_report(report).splitlines()
    assert lines[1].endswith("(the bound): 75.0 %")
    assert lines[2] == (
        "pooled-LRU hit rate (one LRU cache of the cluster's capacity: perfect routing with "
        "LRU eviction): 50.0 %"
    )
    ratio = next(line for line in lines if line.startswith("hit rate / pooled LRU"))
    assert ratio.split()[-2:] == ["1.200", "0.240"]  # 60 % and 12 % of 50 %
    data = report.to_json()
    assert data["pooled_lru_hit_rate"] == 0.5
    assert data["policies"]["cache_aware"]["ratio_to_pooled_lru"] == 1.2
    assert "pooled_lru_hit_rate" not in base.to_json()
    assert not any("pooled" in line for line in format_report(base).splitlines())


def test_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "cluster.png"
    base = _report()
    write_plot(ClusterReport(base.workload, base.num_requests, 0.75, base.runs, 0.5), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_rejects_an_empty_cluster() -> None:
    with pytest.raises(ClusterError, match="at least one worker"):
        ClusterConfig(num_workers=0)


def test_process_group_stops_everything_and_reports_deaths(tmp_path: Path) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    with ProcessGroup(tmp_path, stop_timeout_s=10.0) as group:
        a = group.start("a", sleeper)
        b = group.start("b", sleeper)
        with pytest.raises(ProcessError, match="already running"):
            group.start("a", sleeper)
        dying = group.start("dying", [sys.executable, "-c", "print('bye'); raise SystemExit(3)"])
        dying.wait(timeout=60)
        with pytest.raises(ProcessError, match=r"dying exited with code 3[\s\S]*bye"):
            group.check_alive()
        group.stop(["dying", "a"])
        assert a.poll() is not None
        assert b.poll() is None
    assert b.poll() is not None
    # A stopped process is really gone (no zombie left to signal).
    with pytest.raises(ProcessLookupError):
        os.kill(b.pid, 0)


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux-only")
def test_children_die_when_the_parent_is_killed(tmp_path: Path) -> None:
    parent_code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from router.cluster.processes import ProcessGroup\n"
        f"group = ProcessGroup(Path({str(tmp_path)!r}))\n"
        "child = group.start('child', [sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    root = REPO_ROOT
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    parent.kill()  # SIGKILL: no cleanup code runs in the parent
    parent.wait()
    deadline = time.monotonic() + 60
    while _alive(child_pid):
        assert time.monotonic() < deadline, f"child {child_pid} outlived its killed parent"
        time.sleep(0.05)  # polling /proc for a process we do not own any more


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _workload(argv: list[str], default_trace: Path | None = None) -> Workload:
    args = build_parser().parse_args(argv)
    if default_trace is None:
        return build_workload(args, workload_source(args))
    return build_workload(args, workload_source(args, default_trace))


def test_workload_flags_and_the_missing_trace_fallback(tmp_path: Path) -> None:
    quick = _workload(["--quick"])
    assert quick.name == "mooncake"
    assert len(quick.requests) == 40
    chat = _workload(["--workload", "chat", "--sessions", "5"])
    assert (chat.name, len(chat.requests)) == ("chat", 5 * 4)
    missing = tmp_path / "absent.jsonl"
    fallback = _workload(["--quick"], default_trace=missing)
    assert (fallback.name, len(fallback.requests)) == ("mooncake", 40)
    assert BUILTIN_TRACE_NAME in fallback.description
    with pytest.raises(WorkloadError, match=r"absent\.jsonl"):
        _workload(["--trace", str(missing)], default_trace=missing)
