"""Simulator results: per-policy figures from request outcomes, as a table, JSON or a plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from router.cluster.plot_layout import add_legend, new_figure, save_figure
from router.cluster.workload import TRACE_BLOCK_TOKENS
from router.sim.engine import RequestOutcome
from router.sim.trace import HitRates, IdealHits, SimRequest

__all__ = [
    "PolicyResult",
    "build_figure",
    "format_table",
    "percentile",
    "plot_results",
    "summarize",
]

_TARGET_IMBALANCE: Final = 1.25
"""The max/mean load the cache-aware policy is held to (drawn on the load panel)."""


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of sorted values, nearest-rank; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def _imbalance(values: Sequence[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


@dataclass(frozen=True, slots=True)
class PolicyResult(HitRates):
    """The figures of one policy over one trace.

    Attributes:
        policy: The policy's name.
        num_requests: Requests replayed.
        num_blocks: Trace blocks (512 tokens, the last of a request maybe partial).
        num_hit_blocks: Whole trace blocks found in the chosen workers' caches.
        num_tokens: Prompt tokens.
        num_hit_tokens: Prompt tokens found in the chosen workers' caches.
        num_predicted_tokens: Prompt tokens the router expected to hit.
        ideal: The infinite-cache ideal of the trace.
        pooled_lru: The pooled-LRU bound (:mod:`router.sim.bounds`): one LRU cache of the
            whole cluster's capacity; ``None`` when not computed.
        ttft_mean_s: Mean TTFT.
        requests_per_worker: Requests each worker served.
        prefill_tokens_per_worker: Prompt tokens each worker computed.
        ttft_p50_s: Median time to first token (simulated).
        ttft_p90_s: 90th percentile TTFT.
        ttft_p99_s: 99th percentile TTFT.
        wall_s: Wall-clock seconds the simulation took.
        cpu_s: CPU seconds it took (equal to ``wall_s`` on an idle machine; less when
            other processes share the cores).
    """

    policy: str
    num_requests: int
    num_blocks: int
    num_hit_blocks: int
    num_tokens: int
    num_hit_tokens: int
    num_predicted_tokens: int
    ideal: IdealHits
    requests_per_worker: tuple[int, ...]
    prefill_tokens_per_worker: tuple[int, ...]
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    wall_s: float
    cpu_s: float
    pooled_lru: IdealHits | None = None
    ttft_mean_s: float = 0.0

    @property
    def ratio_to_ideal(self) -> float:
        """Block hit rate over the infinite-cache ideal's."""
        ideal = self.ideal.hit_rate_blocks
        return self.hit_rate_blocks / ideal if ideal else 1.0

    @property
    def ratio_to_pooled_lru(self) -> float | None:
        """Block hit rate over the pooled-LRU bound's; ``None`` without the bound."""
        if self.pooled_lru is None:
            return None
        bound = self.pooled_lru.hit_rate_blocks
        return self.hit_rate_blocks / bound if bound else 1.0

    @property
    def request_imbalance(self) -> float:
        """Max over mean of the requests each worker served."""
        return _imbalance(self.requests_per_worker)

    @property
    def prefill_imbalance(self) -> float:
        """Max over mean of the prompt tokens each worker computed."""
        return _imbalance(self.prefill_tokens_per_worker)

    @property
    def load_imbalance(self) -> float:
        """The worse of :attr:`request_imbalance` and :attr:`prefill_imbalance`."""
        return max(self.request_imbalance, self.prefill_imbalance)

    def to_json(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict (the keys ``kvroute sim --json`` promises first)."""
        return {
            "hit_rate_blocks": self.hit_rate_blocks,
            "hit_rate_tokens": self.hit_rate_tokens,
            "ideal_hit_rate_blocks": self.ideal.hit_rate_blocks,
            "load_imbalance": self.load_imbalance,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "ideal_hit_rate_tokens": self.ideal.hit_rate_tokens,
            "ratio_to_ideal": self.ratio_to_ideal,
            "request_imbalance": self.request_imbalance,
            "prefill_imbalance": self.prefill_imbalance,
            "ttft_p90_s": self.ttft_p90_s,
            "ttft_mean_s": self.ttft_mean_s,
            "predicted_hit_tokens": self.num_predicted_tokens,
            "hit_tokens": self.num_hit_tokens,
            "requests_per_worker": list(self.requests_per_worker),
            "prefill_tokens_per_worker": list(self.prefill_tokens_per_worker),
            "num_requests": self.num_requests,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            **(
                {
                    "pooled_lru_hit_rate_blocks": self.pooled_lru.hit_rate_blocks,
                    "pooled_lru_hit_rate_tokens": self.pooled_lru.hit_rate_tokens,
                    "ratio_to_pooled_lru": self.ratio_to_pooled_lru,
                }
                if self.pooled_lru is not None
                else {}
            ),
        }


def summarize(
    policy: str,
    requests: Sequence[SimRequest],
    outcomes: Sequence[RequestOutcome],
    ideal: IdealHits,
    num_workers: int,
    wall_s: float,
    cpu_s: float,
    pooled_lru: IdealHits | None = None,
) -> PolicyResult:
    """Aggregate one run's outcomes (in trace order, one per request)."""
    per_worker_requests = [0] * num_workers
    per_worker_prefill = [0] * num_workers
    hit_blocks = hit_tokens = predicted = 0
    for request, outcome in zip(requests, outcomes, strict=True):
        assert request.index == outcome.index
        per_worker_requests[outcome.worker] += 1
        per_worker_prefill[outcome.worker] += outcome.prefill_tokens
        hit_tokens += outcome.hit_tokens
        hit_blocks += outcome.hit_tokens // TRACE_BLOCK_TOKENS
        predicted += outcome.predicted_tokens
    ttfts = sorted(o.ttft_s for o in outcomes)
    return PolicyResult(
        policy=policy,
        num_requests=len(requests),
        num_blocks=ideal.num_blocks,
        num_hit_blocks=hit_blocks,
        num_tokens=ideal.num_tokens,
        num_hit_tokens=hit_tokens,
        num_predicted_tokens=predicted,
        ideal=ideal,
        requests_per_worker=tuple(per_worker_requests),
        prefill_tokens_per_worker=tuple(per_worker_prefill),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        wall_s=wall_s,
        cpu_s=cpu_s,
        pooled_lru=pooled_lru,
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
    )


def format_table(results: Sequence[PolicyResult], baseline: str | None = None) -> str:
    """A fixed-width table, one row per policy, with the ratio to ``baseline``'s hit rate."""
    by_name = {r.policy: r for r in results}
    base = by_name.get(baseline) if baseline else None
    header = (
        f"{'policy':<16}{'hit blk':>8}{'hit tok':>8}{'/ideal':>8}{'/LRU':>7}"
        f"{'/' + (baseline or 'base')[:11]:>13}{'max/mean req':>13}{'max/mean pf':>12}"
        f"{'TTFT mean':>10}{'p50':>8}{'p90':>8}{'p99':>8}{'CPU s':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        vs_base = "-"  # no baseline in this run, or it hit nothing
        if base is not None and base.hit_rate_blocks:
            vs_base = f"{r.hit_rate_blocks / base.hit_rate_blocks:.2f}"
        vs_lru = "-" if r.ratio_to_pooled_lru is None else f"{r.ratio_to_pooled_lru:.3f}"
        lines.append(
            f"{r.policy:<16}{r.hit_rate_blocks:>8.2%}{r.hit_rate_tokens:>8.2%}"
            f"{r.ratio_to_ideal:>8.3f}{vs_lru:>7}{vs_base:>13}{r.request_imbalance:>13.2f}"
            f"{r.prefill_imbalance:>12.2f}{r.ttft_mean_s:>10.2f}{r.ttft_p50_s:>8.2f}"
            f"{r.ttft_p90_s:>8.2f}{r.ttft_p99_s:>8.2f}{r.cpu_s:>7.1f}"
        )
    if results:
        ideal = results[0].ideal
        lines.append(
            f"infinite-cache ideal: {ideal.hit_rate_blocks:.2%} of blocks, "
            f"{ideal.hit_rate_tokens:.2%} of tokens"
        )
        lru = results[0].pooled_lru
        if lru is not None:
            lines.append(
                f"pooled-LRU bound (one LRU cache of the cluster's capacity: perfect routing "
                f"with LRU eviction): {lru.hit_rate_blocks:.2%} of blocks, "
                f"{lru.hit_rate_tokens:.2%} of tokens"
            )
    return "\n".join(lines)


def build_figure(results: Sequence[PolicyResult]) -> Any:
    """Bar charts per policy: block hit rate against the infinite-cache ideal, load
    imbalance against the 1.25 target, and simulated TTFT p50 and p99.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'kvroute[plot]'``).
    """
    fig, (ax_hit, ax_load, ax_ttft) = new_figure(3, "kvroute sim: one bar per routing policy")
    names = [r.policy for r in results]
    xs = list(range(len(names)))
    bars = ax_hit.bar(xs, [100 * r.hit_rate_blocks for r in results], color="C0", label="hit rate")
    ax_hit.bar_label(bars, fmt="%.1f", label_type="center", color="white", fontsize="small")
    if results:
        ideal = 100 * results[0].ideal.hit_rate_blocks
        ax_hit.axhline(ideal, color="k", ls="--", label="infinite-cache ideal")
        lru = results[0].pooled_lru
        if lru is not None:
            ax_hit.axhline(100 * lru.hit_rate_blocks, color="k", ls=":", label="pooled LRU")
    ax_hit.set_ylim(0, 105)
    ax_hit.set_ylabel("% of trace blocks")
    ax_hit.set_title("prefix hit rate (blocks)")
    ax_load.bar(xs, [r.load_imbalance for r in results], color="C1", label="load max/mean")
    ax_load.axhline(_TARGET_IMBALANCE, color="r", ls=":", label=f"target {_TARGET_IMBALANCE}")
    ax_load.set_title("load imbalance (max/mean, worse of requests and prefill)")
    width = 0.4
    ax_ttft.bar([x - width / 2 for x in xs], [r.ttft_p50_s for r in results], width,
                color="C2", label="TTFT p50")  # fmt: skip
    ax_ttft.bar([x + width / 2 for x in xs], [r.ttft_p99_s for r in results], width,
                color="C3", label="TTFT p99")  # fmt: skip
    ax_ttft.set_ylabel("simulated seconds")
    ax_ttft.set_title("time to first token")
    for ax in (ax_hit, ax_load, ax_ttft):
        ax.set_xticks(xs, names, rotation=30, ha="right")
    add_legend(fig)
    return fig


def plot_results(results: Sequence[PolicyResult], path: str | Path) -> None:
    """Write :func:`build_figure` as a PNG.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'kvroute[plot]'``).
    """
    save_figure(build_figure(results), path, dpi=110)
