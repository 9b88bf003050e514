"""Routing accuracy, measured live: the cache hits the router expected against those workers report.

For every proxied request the router knows what it expected the serving worker to hit
(the prefix its decision credited that worker with) and the worker says what it hit
(``usage.cached_tokens``, or ``usage.prompt_tokens_details.cached_tokens`` in vLLM's
shape). When they agree, the router sees the workers' caches as they are; when they
disagree persistently, something between them is wrong, and the likely causes are few:
a tokenizer or chat template other than the worker's, a registration's block size, KV
events that do not arrive, a restart or reset the router missed.

:class:`RoutingAccuracy` keeps, per worker, a window of its last ``window_requests``
requests and measures their agreement: ``sum(min(expected, reported)) /
sum(max(expected, reported))``, 1 when every request hit exactly what the router expected,
falling towards 0 when the router over-promises (claims blocks the worker lost) or
under-promises (the worker holds prefixes the router does not see). A plain
``reported / expected`` would rise above 1 in the second case and fall in the first, so a
dashboard could not tell good from bad by one line; the two totals stay available for it
(``kvroute_router_expected_cached_tokens_total``,
``kvroute_router_reported_cached_tokens_total``). Once a worker's full window agrees less
than ``warn_below_ratio`` (with at least ``min_tokens`` of hits at stake) one WARNING names
the worker, the figures, the direction and the likely causes, at most once per
``warn_interval_s`` per worker.

Pure apart from logging: the caller passes the clock.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from router.errors import RouterError

__all__ = [
    "ACCURACY_RATIO",
    "EXPECTED_CACHED_TOKENS",
    "REPORTED_CACHED_TOKENS",
    "AccuracyCollector",
    "AccuracyConfig",
    "ReportedAccuracy",
    "RoutingAccuracy",
    "WindowFigures",
    "expected_hit_tokens",
    "parse_router_accuracy",
    "reported_usage",
]

logger = logging.getLogger(__name__)

ACCURACY_RATIO: Final = "kvroute_router_routing_accuracy_ratio"
EXPECTED_CACHED_TOKENS: Final = "kvroute_router_expected_cached_tokens"
"""Counter of the hit tokens the router expected (``_total`` on the wire), per worker."""
REPORTED_CACHED_TOKENS: Final = "kvroute_router_reported_cached_tokens"
"""Counter of the hit tokens the workers reported (``_total`` on the wire), per worker."""


@dataclass(frozen=True, slots=True)
class AccuracyConfig:
    """When routing accuracy is judged and warned about.

    Attributes:
        window_requests: Requests per worker the figure covers (its last ones).
        warn_below_ratio: Agreement below which a full window is warned about.
        min_tokens: Hit tokens at stake in a window (the larger of expected and reported,
            summed) below which no figure is given: a few short prompts prove nothing.
        warn_interval_s: Least time between two warnings about one worker.
    """

    window_requests: int = 100
    warn_below_ratio: float = 0.5
    min_tokens: int = 1024
    warn_interval_s: float = 600.0

    def __post_init__(self) -> None:
        if self.window_requests < 1:
            raise RouterError(f"accuracy window must be >= 1 request, got {self.window_requests}")
        if not 0.0 <= self.warn_below_ratio <= 1.0:
            raise RouterError(
                f"accuracy warning ratio must be in [0, 1], got {self.warn_below_ratio}"
            )
        if self.min_tokens < 1:
            raise RouterError(f"accuracy min tokens must be >= 1, got {self.min_tokens}")
        if not self.warn_interval_s >= 0:
            raise RouterError(
                f"accuracy warning interval must be >= 0 s, got {self.warn_interval_s}"
            )


def expected_hit_tokens(predicted_tokens: int, num_prompt_tokens: int, block_size: int) -> int:
    """The prefix hit a worker can give for what the router credited it with.

    An engine computes at least the last prompt token, and hits whole blocks only: at most
    ``(num_prompt_tokens - 1) // block_size`` blocks, whatever the router credited.

    Args:
        predicted_tokens: Tokens the decision credited the worker with (index matches and
            predicted entries).
        num_prompt_tokens: The prompt's length, in the router's tokens.
        block_size: The worker's registered block size.
    """
    if num_prompt_tokens < 1 or block_size < 1:
        return 0
    tokens = min(predicted_tokens, num_prompt_tokens - 1)
    return max(tokens, 0) // block_size * block_size


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def reported_usage(usage: Mapping[str, object] | None) -> tuple[int | None, int | None]:
    """``(cached tokens, prompt tokens)`` a worker's ``usage`` reports (``None``: absent).

    kvroute workers report ``usage.cached_tokens``; vLLM reports
    ``usage.prompt_tokens_details.cached_tokens`` (with ``--enable-prompt-tokens-details``).
    """
    if not usage:
        return None, None
    cached = _count(usage.get("cached_tokens"))
    details = usage.get("prompt_tokens_details")
    if cached is None and isinstance(details, dict):
        cached = _count(details.get("cached_tokens"))
    return cached, _count(usage.get("prompt_tokens"))


@dataclass(frozen=True, slots=True)
class _Served:
    expected: int
    reported: int
    prompt_mismatch: tuple[int, int] | None  # (router's, worker's) prompt tokens


@dataclass(frozen=True, slots=True)
class WindowFigures:
    """One worker's window.

    Attributes:
        num_requests: Requests in it.
        expected_tokens: Hit tokens the router expected, summed.
        reported_tokens: Hit tokens the worker reported, summed.
        agreed_tokens: ``min(expected, reported)`` summed.
        at_stake_tokens: ``max(expected, reported)`` summed.
        num_prompt_mismatches: Requests whose prompt length the worker counted otherwise.
        last_prompt_mismatch: The last one's ``(router's, worker's)`` prompt tokens.
    """

    num_requests: int
    expected_tokens: int
    reported_tokens: int
    agreed_tokens: int
    at_stake_tokens: int
    num_prompt_mismatches: int
    last_prompt_mismatch: tuple[int, int] | None

    @property
    def ratio(self) -> float:
        """Agreement in [0, 1] (1 when nothing is at stake)."""
        return self.agreed_tokens / self.at_stake_tokens if self.at_stake_tokens else 1.0


class _Window:
    """The last N requests of one worker, with running sums."""

    def __init__(self, size: int) -> None:
        self.served: collections.deque[_Served] = collections.deque(maxlen=size)
        self.expected = self.reported = self.agreed = self.at_stake = self.mismatches = 0

    def add(self, served: _Served) -> None:
        if len(self.served) == self.served.maxlen:
            self._apply(self.served[0], -1)
        self.served.append(served)
        self._apply(served, 1)

    def _apply(self, s: _Served, sign: int) -> None:
        self.expected += sign * s.expected
        self.reported += sign * s.reported
        self.agreed += sign * min(s.expected, s.reported)
        self.at_stake += sign * max(s.expected, s.reported)
        self.mismatches += sign * (s.prompt_mismatch is not None)

    def figures(self) -> WindowFigures:
        last = next((s.prompt_mismatch for s in reversed(self.served) if s.prompt_mismatch), None)
        return WindowFigures(
            len(self.served), self.expected, self.reported, self.agreed, self.at_stake,
            self.mismatches, last,
        )  # fmt: skip


class RoutingAccuracy:
    """Per-worker windows of expected against reported hits, and the warnings they call for.

    Args:
        config: Window, thresholds and warning interval.
        log: Where warnings go (this module's logger by default).
    """

    def __init__(self, config: AccuracyConfig, log: logging.Logger = logger) -> None:
        self.config = config
        self._log = log
        self._windows: dict[str, _Window] = {}
        self._warned_at: dict[str, float] = {}
        self._unreported_warned_at: dict[str, float] = {}

    def observe(
        self,
        worker: str,
        expected_tokens: int,
        reported_tokens: int,
        router_prompt_tokens: int,
        worker_prompt_tokens: int | None,
        now: float,
    ) -> None:
        """One request the worker served and reported its hit for; may log a warning."""
        mismatch = None
        if worker_prompt_tokens is not None and worker_prompt_tokens != router_prompt_tokens:
            mismatch = (router_prompt_tokens, worker_prompt_tokens)
        window = self._windows.get(worker)
        if window is None:
            window = self._windows[worker] = _Window(self.config.window_requests)
        window.add(_Served(expected_tokens, reported_tokens, mismatch))
        figures = window.figures()
        if (
            figures.num_requests == self.config.window_requests
            and figures.at_stake_tokens >= self.config.min_tokens
            and figures.ratio < self.config.warn_below_ratio
            and now >= self._warned_at.get(worker, float("-inf")) + self.config.warn_interval_s
        ):
            self._warned_at[worker] = now
            self._log.warning("%s", self.explain(worker, figures))

    def unreported(self, worker: str, now: float) -> None:
        """The worker answered without a cached-token count: say once per interval that
        its accuracy cannot be measured, and how to fix that."""
        if (
            now
            < self._unreported_warned_at.get(worker, float("-inf")) + self.config.warn_interval_s
        ):
            return
        self._unreported_warned_at[worker] = now
        self._log.warning(
            "worker %s answered without usage.cached_tokens (nor "
            "usage.prompt_tokens_details.cached_tokens): its routing accuracy is not "
            "measured; start a vLLM engine with --enable-prompt-tokens-details",
            worker,
        )

    def figures(self) -> dict[str, WindowFigures]:
        """Each worker's window with enough at stake to be judged (``min_tokens``)."""
        out = {}
        for worker, window in self._windows.items():
            if window.at_stake >= self.config.min_tokens:
                out[worker] = window.figures()
        return out

    def forget(self, worker: str) -> None:
        """Drop a worker's window (it left the cluster)."""
        self._windows.pop(worker, None)
        self._warned_at.pop(worker, None)
        self._unreported_warned_at.pop(worker, None)

    def explain(self, worker: str, f: WindowFigures) -> str:
        """The warning about one worker's window: figures, direction, likely causes."""
        head = (
            f"worker {worker}: routing accuracy {f.ratio:.2f} over its last "
            f"{f.num_requests} requests: it reported {f.reported_tokens:,} cached prompt "
            f"tokens where the router expected {f.expected_tokens:,}"
        )
        if f.last_prompt_mismatch is not None:
            ours, theirs = f.last_prompt_mismatch
            tokenizer = (
                f"; {f.num_prompt_mismatches} of them the worker counted otherwise (last: "
                f"{theirs} prompt tokens where the router counted {ours}): the router's "
                "--tokenizer or --chat-template is not the worker's (or the worker adds "
                "special tokens such as a BOS)"
            )
        else:
            tokenizer = ""
        if f.reported_tokens > f.expected_tokens:
            causes = (
                "the router does not see what this worker caches. Likely causes: a "
                "tokenizer or chat template other than the worker's; a block size in its "
                "registration other than the engine's; its KV events not reaching the "
                "router (lost events, a wrong events endpoint or CURVE key: see "
                "kvroute_stream_* and kvroute_ingest_* for this worker)"
            )
        else:
            causes = (
                "the index claims blocks this worker does not hold. Likely causes: lost "
                "BlockRemoved events (kvroute_stream_gaps_total); a restart or cache reset "
                "the router missed (an engine without a fixed PYTHONHASHSEED hashes anew "
                "after a restart); a block size in its registration other than the "
                "engine's; a tokenizer or chat template other than the worker's; or bursts "
                "of requests sharing a new prefix, computed in parallel (transient)"
            )
        interval = self.config.warn_interval_s
        return (
            f"{head}{tokenizer}; {causes}. `kvroute index check --router URL` shows the "
            f"figures; next warning about this worker in {interval:g} s at the earliest"
        )


class AccuracyCollector(Collector):
    """Exports ``kvroute_router_routing_accuracy_ratio{worker}`` at scrape time, for the
    workers with enough at stake (a worker without a figure has no sample)."""

    def __init__(self, read: Callable[[], Mapping[str, WindowFigures]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            ACCURACY_RATIO,
            "Agreement of the cache hits the router expected with those the worker "
            "reported, over its last requests: sum(min(expected, reported)) / "
            "sum(max(expected, reported)); 1 = the router sees the worker's cache as it is.",
            labels=["worker"],
        )
        for worker, figures in sorted(self._read().items()):
            family.add_metric([worker], figures.ratio)
        yield family


@dataclass(frozen=True, slots=True)
class ReportedAccuracy:
    """One worker's routing accuracy as a router's ``/metrics`` shows it.

    Attributes:
        expected_cached_tokens: Hit tokens the router expected, since it started.
        reported_cached_tokens: Hit tokens the worker reported, since then.
        ratio: The agreement over the worker's last requests (``None``: too little at
            stake for a figure).
    """

    expected_cached_tokens: int
    reported_cached_tokens: int
    ratio: float | None


def parse_router_accuracy(text: str) -> dict[str, ReportedAccuracy]:
    """Each worker's routing accuracy in a router's Prometheus ``/metrics`` text."""
    totals: dict[str, dict[str, float]] = {}
    ratios: dict[str, float] = {}
    wanted = {f"{EXPECTED_CACHED_TOKENS}_total", f"{REPORTED_CACHED_TOKENS}_total"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            worker = sample.labels.get("worker")
            if worker is None:
                continue
            if sample.name in wanted:
                totals.setdefault(worker, {})[sample.name] = sample.value
            elif sample.name == ACCURACY_RATIO:
                ratios[worker] = sample.value
    return {
        worker: ReportedAccuracy(
            int(totals.get(worker, {}).get(f"{EXPECTED_CACHED_TOKENS}_total", 0)),
            int(totals.get(worker, {}).get(f"{REPORTED_CACHED_TOKENS}_total", 0)),
            ratios.get(worker),
        )
        for worker in sorted(totals.keys() | ratios.keys())
    }
