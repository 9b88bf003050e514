"""The PNG reports of `kvroute cluster` and `kvroute sim`: legends off the data, labels, axes."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from router.cli.sim import pool_cache_factory, run_policies
from router.cluster.report import (
    ClusterReport,
    PolicyRun,
    RequestResult,
    WorkerStats,
    build_figure,
    write_plot,
)
from router.cluster.trace_generator import generate_trace
from router.sim.engine import SimConfig
from router.sim.report import build_figure as sim_figure
from router.sim.report import plot_results
from router.sim.trace import to_requests

pytestmark = pytest.mark.slow

pytest.importorskip("matplotlib")


def _cluster_report() -> ClusterReport:
    rng = random.Random(3)

    def run(policy: str, hit: float, ttft_s: float, served: list[int]) -> PolicyRun:
        results = tuple(
            RequestResult(
                prompt_tokens=400,
                cached_tokens=int(400 * hit * rng.random()),
                output_tokens=8,
                ttft_s=ttft_s * rng.lognormvariate(0, 1.5),  # spans decades: a log axis
                latency_s=1.0,
            )
            for _ in range(sum(served))
        )
        workers = tuple(WorkerStats(f"worker-{i}", n, 400 * n, 0) for i, n in enumerate(served))
        return PolicyRun(policy, workers, results, wall_s=10.0)

    runs = (run("cache_aware", 0.9, 0.05, [52, 48]), run("round_robin", 0.3, 0.2, [50, 50]))
    return ClusterReport("100 test requests", 100, 0.95, runs)


def _check_layout(fig: Any) -> None:
    """One legend, outside every panel; every line and bar series labelled in it."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert len(fig.legends) == 1
    legend = fig.legends[0]
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert ax.get_legend() is None  # no legend inside a panel
        assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
    labels = {text.get_text() for text in legend.get_texts()}
    for ax in fig.axes:
        for line in ax.get_lines():
            assert not line.get_label().startswith("_"), (ax.get_title(), line)
            assert line.get_label() in labels
        for container in ax.containers:
            if hasattr(container, "patches"):
                assert container.get_label() in labels, ax.get_title()


def test_cluster_plot(tmp_path: Path) -> None:
    report = _cluster_report()
    fig = build_figure(report)
    try:
        _check_layout(fig)
        ttft = next(ax for ax in fig.axes if "time to first token" in ax.get_title())
        assert ttft.get_xscale() == "log"
        labels = {t.get_text() for t in fig.legends[0].get_texts()}
        assert {"cache_aware", "round_robin", "infinite cache (bound)", "even share"} <= labels
    finally:
        fig.clf()
    path = tmp_path / "cluster.png"
    write_plot(report, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000  # three drawn panels, not an empty canvas


def test_sim_plot(tmp_path: Path) -> None:
    requests = to_requests(generate_trace(120))
    config = SimConfig(num_workers=2, capacity_blocks=2048)
    results = run_policies(requests, ["cache_aware", "round_robin"], config, pool_cache_factory())
    fig = sim_figure(results)
    try:
        _check_layout(fig)
        labels = {t.get_text() for t in fig.legends[0].get_texts()}
        assert {"infinite-cache ideal", "target 1.25", "TTFT p50", "TTFT p99"} <= labels
    finally:
        fig.clf()
    path = tmp_path / "sim.png"
    plot_results(results, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000
