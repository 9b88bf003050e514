"""The figures of a ``kvroute cluster`` run and their presentation: a table and a PNG plot.

Per request, the client's measurements (:class:`RequestResult`); per worker, what its own
``/metrics`` says it served (:class:`WorkerStats`); per policy, the figures derived from
both (:class:`PolicyRun`); and the whole report (:class:`ClusterReport`), printed by
:func:`format_report` with every policy's ratio to the last one (the baseline) and drawn by
:func:`write_plot`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from router.cluster.plot_layout import add_legend, new_figure, save_figure

__all__ = [
    "ClusterReport",
    "PolicyRun",
    "RequestResult",
    "WorkerStats",
    "build_figure",
    "format_report",
    "percentile",
    "write_plot",
]


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request measured.

    Attributes:
        prompt_tokens: Prompt length.
        cached_tokens: Prompt tokens the worker served from its prefix cache.
        output_tokens: Tokens generated.
        ttft_s: Seconds from sending to the first generated token.
        latency_s: Seconds from sending to the end of the response.
        error: Why it failed; ``None`` when it succeeded.
    """

    prompt_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the request succeeded."""
        return self.error is None


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0-100) of ``values``; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil without floats drifting
    return ordered[min(len(ordered), int(rank)) - 1]


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """What one worker served during a run, from its own ``/metrics``.

    Attributes:
        worker_id: The worker.
        num_requests: Completions it finished.
        prompt_tokens: Prompt tokens it was sent.
        cached_tokens: Prompt tokens it found in its prefix cache.
    """

    worker_id: str
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens it had to compute (its prefill load)."""
        return self.prompt_tokens - self.cached_tokens


def _imbalance(values: Sequence[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 0.0


@dataclass(frozen=True)
class PolicyRun:
    """The workload's results under one policy.

    Attributes:
        policy: The routing policy.
        workers: What each worker served.
        results: One per request, in workload order.
        wall_s: Seconds from the first request sent to the last answer.
    """

    policy: str
    workers: tuple[WorkerStats, ...]
    results: tuple[RequestResult, ...]
    wall_s: float

    @property
    def num_failed(self) -> int:
        """Requests that failed."""
        return sum(not r.ok for r in self.results)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the successful requests."""
        return sum(r.prompt_tokens for r in self.results if r.ok)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from a prefix cache."""
        return sum(r.cached_tokens for r in self.results if r.ok)

    @property
    def hit_rate(self) -> float:
        """Cached over prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ttft_p50_s(self) -> float:
        """Median time to first token."""
        return percentile([r.ttft_s for r in self.results if r.ok], 50)

    @property
    def ttft_p99_s(self) -> float:
        """99th percentile time to first token."""
        return percentile([r.ttft_s for r in self.results if r.ok], 99)

    @property
    def throughput_rps(self) -> float:
        """Successful requests per second of wall time."""
        ok = len(self.results) - self.num_failed
        return ok / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_worker(self) -> dict[str, int]:
        """Requests each worker finished."""
        return {w.worker_id: w.num_requests for w in self.workers}

    @property
    def load_imbalance(self) -> float:
        """Most requests on one worker over the mean (1.0 is perfectly even)."""
        return _imbalance([w.num_requests for w in self.workers])

    @property
    def prefill_imbalance(self) -> float:
        """Most prompt tokens computed by one worker over the mean."""
        return _imbalance([w.computed_tokens for w in self.workers])

    def summary(self) -> dict[str, Any]:
        """The figures of the report, JSON-ready."""
        return {
            "policy": self.policy,
            "requests": len(self.results),
            "failed": self.num_failed,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.hit_rate,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "throughput_rps": self.throughput_rps,
            "wall_s": self.wall_s,
            "requests_per_worker": self.requests_per_worker,
            "load_imbalance": self.load_imbalance,
            "prefill_imbalance": self.prefill_imbalance,
            "workers": {
                w.worker_id: {
                    "requests": w.num_requests,
                    "prompt_tokens": w.prompt_tokens,
                    "cached_tokens": w.cached_tokens,
                }
                for w in self.workers
            },
        }


@dataclass(frozen=True)
class ClusterReport:
    """Every policy's run of one workload.

    Attributes:
        workload: Description of the workload.
        num_requests: Requests in the workload.
        ideal_hit_rate: Hit rate of one infinite cache over the workload (the bound).
        runs: One per policy, in the order run.
        pooled_lru_hit_rate: Hit rate (tokens) of one LRU cache with the cluster's total
            capacity (:mod:`router.sim.bounds`): perfect routing with LRU eviction, the
            reachable bound when the workload outgrows the cache; ``None``: not computed.
    """

    workload: str
    num_requests: int
    ideal_hit_rate: float
    runs: tuple[PolicyRun, ...]
    pooled_lru_hit_rate: float | None = None

    def ratio_to_pooled_lru(self, run: PolicyRun) -> float | None:
        """``run``'s hit rate over the pooled-LRU bound's; ``None`` without the bound."""
        bound = self.pooled_lru_hit_rate
        if bound is None:
            return None
        return run.hit_rate / bound if bound else 1.0

    def to_json(self) -> dict[str, Any]:
        """The report as one JSON object (``policies`` maps a name to its figures)."""
        out: dict[str, Any] = {
            "workload": self.workload,
            "num_requests": self.num_requests,
            "ideal_hit_rate": self.ideal_hit_rate,
            "policies": {run.policy: run.summary() for run in self.runs},
        }
        if self.pooled_lru_hit_rate is not None:
            out["pooled_lru_hit_rate"] = self.pooled_lru_hit_rate
            for run in self.runs:
                out["policies"][run.policy]["ratio_to_pooled_lru"] = self.ratio_to_pooled_lru(run)
        return out


def _ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x" if baseline else "-"


_ROWS: Final[tuple[tuple[str, Callable[[PolicyRun], float], Callable[[float], str]], ...]] = (
    ("prefix hit rate (tokens)", lambda r: r.hit_rate, lambda v: f"{100 * v:.1f} %"),
    ("cached tokens", lambda r: r.cached_tokens, lambda v: f"{int(v):,}"),
    ("TTFT p50", lambda r: r.ttft_p50_s, lambda v: f"{1000 * v:.0f} ms"),
    ("TTFT p99", lambda r: r.ttft_p99_s, lambda v: f"{1000 * v:.0f} ms"),
    ("throughput", lambda r: r.throughput_rps, lambda v: f"{v:.2f} req/s"),
    ("wall time", lambda r: r.wall_s, lambda v: f"{v:.1f} s"),
    ("load max/mean (requests)", lambda r: r.load_imbalance, lambda v: f"{v:.2f}"),
    ("load max/mean (computed tokens)", lambda r: r.prefill_imbalance, lambda v: f"{v:.2f}"),
    ("failed requests", lambda r: r.num_failed, lambda v: f"{int(v)}"),
)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [
        fmt.format(*row) for row in rows
    ]


def format_report(report: ClusterReport) -> str:
    """The report as text: a figure table with ratios, then per-worker requests."""
    runs = report.runs
    baseline = runs[-1]
    others = runs[:-1]
    header = ["", *(r.policy for r in runs), *(f"{r.policy}/{baseline.policy}" for r in others)]
    rows = [
        [label, *(fmt(get(r)) for r in runs), *(_ratio(get(r), get(baseline)) for r in others)]
        for label, get, fmt in _ROWS
    ]
    lines = [
        f"workload: {report.workload}",
        "infinite-cache hit rate of this workload (the bound): "
        f"{100 * report.ideal_hit_rate:.1f} %",
    ]
    if report.pooled_lru_hit_rate is not None:
        lines.append(
            "pooled-LRU hit rate (one LRU cache of the cluster's capacity: perfect routing "
            f"with LRU eviction): {100 * report.pooled_lru_hit_rate:.1f} %"
        )
        ratios = [report.ratio_to_pooled_lru(r) or 0.0 for r in runs]
        rows.insert(
            1, ["hit rate / pooled LRU", *(f"{v:.3f}" for v in ratios), *([""] * len(others))]
        )
    lines += [
        "",
        *_table(header, rows),
        "",
        "requests per worker:",
    ]
    workers = sorted({w for r in runs for w in r.requests_per_worker})
    load_rows = [[w, *(str(r.requests_per_worker.get(w, 0)) for r in runs)] for w in workers]
    lines += _table(["worker", *(r.policy for r in runs)], load_rows)
    return "\n".join(lines)


def build_figure(report: ClusterReport) -> Any:
    """The report's figure: hit rate per policy against the infinite cache, the TTFT
    distribution per policy (log time axis: a few slow requests span decades), and the
    requests each worker served against an even share.

    Raises:
        ImportError: matplotlib is not installed.
    """
    runs = report.runs
    fig, (ax_hit, ax_ttft, ax_load) = new_figure(3, f"kvroute cluster: {report.workload}")
    colours = {run.policy: f"C{i}" for i, run in enumerate(runs)}
    for run in runs:  # one series per policy: its label and colour match the other panels
        bars = ax_hit.bar(
            run.policy, 100 * run.hit_rate, color=colours[run.policy], label=run.policy
        )
        ax_hit.bar_label(bars, fmt="%.1f %%", label_type="center", color="white")
    ax_hit.axhline(
        100 * report.ideal_hit_rate, color="gray", linestyle="--", label="infinite cache (bound)"
    )
    ax_hit.set_ylim(0, 105)
    if report.pooled_lru_hit_rate is not None:
        ax_hit.axhline(
            100 * report.pooled_lru_hit_rate, color="black", linestyle=":", label="pooled LRU"
        )
    ax_hit.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax_hit.set_title("prefix cache hits")
    for run in runs:
        ttfts = sorted(1000 * r.ttft_s for r in run.results if r.ok)
        shares = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        ax_ttft.step(ttfts, shares, where="post", color=colours[run.policy], label=run.policy)
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("TTFT (ms, log scale)")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.set_title("time to first token (CDF)")
    workers = sorted({w for r in runs for w in r.requests_per_worker})
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        xs = [i + k * width for i in range(len(workers))]
        counts = [run.requests_per_worker.get(w, 0) for w in workers]
        ax_load.bar(xs, counts, width, color=colours[run.policy], label=run.policy)
    if workers:
        even = report.num_requests / len(workers)
        ax_load.axhline(even, color="gray", linestyle=":", label="even share")
    ax_load.set_xticks([i + 0.4 - width / 2 for i in range(len(workers))], workers)
    ax_load.set_ylabel("requests served")
    ax_load.set_title("per-worker load")
    add_legend(fig)
    return fig


def write_plot(report: ClusterReport, path: Path) -> None:
    """Write :func:`build_figure` as a PNG.

    Raises:
        ImportError: matplotlib is not installed.
    """
    save_figure(build_figure(report), path)
