"""Where the trace-driven commands get their requests: a trace file or the built-in generator.

``kvroute sim`` and ``kvroute cluster`` take the same decision, in this order:

1. ``--trace FILE`` when given (any Mooncake-format JSONL);
2. else the Mooncake synthetic trace at :data:`DEFAULT_TRACE_PATH`, when a checkout has
   it beside it (``../shared/data/mooncake/``; an optional input, never required);
3. else :func:`router.cluster.trace_generator.generate_trace`, the built-in workload.

Both commands print :meth:`TraceSource.describe` first, so a run always says which it used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from router.cluster.trace_generator import BUILTIN_TRACE_NAME, GeneratorConfig, generate_trace
from router.cluster.workload import (
    TraceRecord,
    Workload,
    WorkloadError,
    read_trace,
    select_families,
    trace_requests,
)

__all__ = [
    "BUILTIN_NUM_REQUESTS",
    "DEFAULT_TRACE_PATH",
    "TraceSource",
    "choose_trace",
    "trace_workload",
]

DEFAULT_TRACE_PATH: Final = (
    Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"
)
"""Where a checkout may find the Mooncake synthetic trace: ``../shared/data/mooncake/``."""

BUILTIN_NUM_REQUESTS: Final = 6000
"""Requests in the built-in trace when no count is asked for (about 28 minutes of arrivals)."""


@dataclass(frozen=True, slots=True)
class TraceSource:
    """A chosen source of Mooncake-format requests.

    Attributes:
        path: The trace file; ``None`` for the built-in generator.
        why: Why this source was chosen, for the first line of output.
        is_given: The user named the file (``--trace``), rather than the default lookup.
        config: The generator's statistics (used when ``path`` is ``None``).
    """

    path: Path | None
    why: str
    is_given: bool = False
    config: GeneratorConfig = field(default_factory=GeneratorConfig)

    @property
    def name(self) -> str:
        """The trace file's name, or :data:`BUILTIN_TRACE_NAME`."""
        return BUILTIN_TRACE_NAME if self.path is None else self.path.name

    def describe(self) -> str:
        """One line saying which trace runs and why (the first line a command prints)."""
        if self.path is None:
            return f"workload: {BUILTIN_TRACE_NAME} ({self.why}; docs/workload.md)"
        return f"workload: trace {self.path} ({self.why})"

    def records(self, num_requests: int | None = None, seed: int = 0) -> list[TraceRecord]:
        """The first ``num_requests`` records (``None``: the whole file, or the built-in's
        :data:`BUILTIN_NUM_REQUESTS`).

        Raises:
            WorkloadError: The file cannot be read, or ``num_requests`` is not positive.
        """
        if num_requests is not None and num_requests <= 0:
            raise WorkloadError(f"the request count must be positive, got {num_requests}")
        if self.path is None:
            return generate_trace(num_requests or BUILTIN_NUM_REQUESTS, self.config, seed)
        try:
            records = read_trace(self.path)
        except WorkloadError as exc:
            if not self.is_given:
                raise
            raise WorkloadError(f"{exc}; fix --trace, or leave it out to use the default") from exc
        return records if num_requests is None else records[:num_requests]


def choose_trace(trace: str | Path | None, default: Path = DEFAULT_TRACE_PATH) -> TraceSource:
    """The source of requests: ``trace`` if given, else ``default`` if it exists, else built-in.

    Args:
        trace: The ``--trace`` flag (``None`` when absent).
        default: Where to look for a trace when none is given.
    """
    if trace is not None:
        return TraceSource(Path(trace), "--trace", is_given=True)
    if default.is_file():
        return TraceSource(default, "found beside the checkout; --trace FILE picks another")
    return TraceSource(None, f"no --trace given and no trace at {default}")


def trace_workload(
    source: TraceSource,
    *,
    num_requests: int = 200,
    num_families: int = 64,
    block_scale: int = 16,
    max_output_tokens: int = 16,
    seed: int = 0,
) -> Workload:
    """A slice of a trace's requests as token ids, for real workers.

    Args:
        source: The trace (a file or the built-in generator, whose whole default
            length is generated before slicing, as a file is read whole).
        num_requests: Requests in the slice.
        num_families: Prefix families the slice draws from (see
            :func:`router.cluster.workload.select_families`).
        block_scale: Tokens per 512-token trace block.
        max_output_tokens: Upper bound on any request's ``max_tokens``.
        seed: Seed of the token ids (and of the built-in trace).

    Raises:
        WorkloadError: The trace cannot be read or a parameter is out of range.
    """
    records = select_families(source.records(seed=seed), num_families, num_requests)
    requests = trace_requests(
        records, block_scale=block_scale, max_output_tokens=max_output_tokens, seed=seed
    )
    return Workload(
        name="mooncake",
        description=(
            f"{len(requests)} requests of the {num_families} largest prefix families of "
            f"{source.name}, {block_scale} tokens per 512-token trace block"
        ),
        requests=tuple(requests),
    )
