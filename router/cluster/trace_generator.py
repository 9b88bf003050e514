"""The built-in workload: a seeded generator of Mooncake-format traces of multi-turn sessions.

It stands in for a real trace when none is at hand, so ``kvroute sim`` and
``kvroute cluster`` run from a bare clone. Its output is exactly what
:func:`router.cluster.workload.read_trace` returns for a trace file (``timestamp`` in ms,
``input_length``, ``output_length``, one ``hash_ids`` entry per 512-token block, equal ids
meaning an equal prefix), so the simulator and the cluster consume it like any trace.

The model (every parameter is a field of :class:`GeneratorConfig`; the figures it yields
are in ``docs/workload.md``):

- Sessions start as a Poisson process; a session has a geometric number of turns,
  separated by exponential think times.
- Most sessions open with the shared prefix of a family (a system prompt with tools or
  few-shot examples); families are picked by a Zipf law, so a few are very popular and
  most are rare. The other sessions share nothing with anyone.
- After the family prefix comes the session's own context (a document, code), then, per
  turn, a user message; the prompt of turn ``t`` is the whole conversation so far: every
  earlier user message followed by the reply actually requested (``output_length`` tokens).
- Lengths are log-normal, clipped.

Block ids are chained like a real trace's: a block's id names its content and everything
before it, so two prompts share block ``j`` exactly when their first ``(j + 1) * 512``
tokens are equal. Ids are numbered in order of first appearance.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from router.cluster.workload import TRACE_BLOCK_TOKENS, TraceRecord, WorkloadError

__all__ = ["BUILTIN_TRACE_NAME", "GeneratorConfig", "LogNormal", "generate_trace"]

BUILTIN_TRACE_NAME: Final = "the built-in generated trace"
"""How reports name the generator's output (in place of a trace file name)."""


class LogNormal(NamedTuple):
    """A log-normal length distribution, clipped to ``[low, high]`` tokens.

    Attributes:
        median: The median before clipping (``exp(mu)``).
        sigma: Standard deviation of the logarithm.
        low: Smallest value drawn.
        high: Largest value drawn.
    """

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        """One length from this distribution."""
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.high, max(self.low, value))


@dataclass(frozen=True, slots=True)
class GeneratorConfig:
    """The statistics of the generated trace (``docs/workload.md`` shows what they give).

    Attributes:
        requests_per_s: Mean request rate over the whole trace; sessions start at
            ``requests_per_s / mean_turns`` per second.
        mean_turns: Mean turns (requests) per session; geometric.
        max_turns: Upper bound on a session's turns.
        think_time_s: Mean gap between two turns of a session; exponential.
        num_families: Shared-prefix families.
        family_zipf: Zipf exponent of family popularity: family ``k`` (from 1) is chosen
            with probability proportional to ``k ** -family_zipf``.
        family_fraction: Fraction of sessions that open with a family's prefix.
        family_tokens: Length of each family's shared prefix (drawn once per family).
        context_tokens: Length of a session's own context, after the family prefix.
        user_tokens: Length of each user message.
        output_tokens: Tokens each request generates; the reply joins the conversation.
    """

    requests_per_s: float = 4.0
    mean_turns: float = 4.0
    max_turns: int = 32
    think_time_s: float = 30.0
    num_families: int = 100
    family_zipf: float = 1.0
    family_fraction: float = 0.8
    family_tokens: LogNormal = field(default_factory=lambda: LogNormal(3072, 0.8, 256, 16384))
    context_tokens: LogNormal = field(default_factory=lambda: LogNormal(8192, 1.0, 0, 65536))
    user_tokens: LogNormal = field(default_factory=lambda: LogNormal(128, 1.0, 4, 4096))
    output_tokens: LogNormal = field(default_factory=lambda: LogNormal(128, 1.0, 1, 2048))

    def __post_init__(self) -> None:
        if not (self.requests_per_s > 0 and self.think_time_s >= 0 and self.mean_turns >= 1):
            raise WorkloadError(
                "requests_per_s must be > 0, think_time_s >= 0 and mean_turns >= 1, got "
                f"{self.requests_per_s}, {self.think_time_s}, {self.mean_turns}"
            )
        if self.max_turns < 1 or self.num_families < 1 or not 0 <= self.family_fraction <= 1:
            raise WorkloadError(
                "max_turns and num_families must be >= 1 and family_fraction in [0, 1], got "
                f"{self.max_turns}, {self.num_families}, {self.family_fraction}"
            )

    def summary(self) -> str:
        """One sentence stating the model's parameters (for ``--help``)."""
        return (
            f"Poisson arrivals at {self.requests_per_s:g} requests/s; sessions of "
            f"{self.mean_turns:g} turns on average (geometric), {self.think_time_s:g} s "
            f"apart; {self.family_fraction:.0%} of sessions open with one of "
            f"{self.num_families} shared prefixes (Zipf {self.family_zipf:g}, median "
            f"{self.family_tokens.median:g} tokens), then a context of median "
            f"{self.context_tokens.median:g} tokens; user messages and replies of median "
            f"{self.user_tokens.median:g} and {self.output_tokens.median:g} tokens"
        )


class _Segment(NamedTuple):
    """A stretch of a prompt: content ``uid`` (shared by every prompt holding it) and length."""

    uid: int
    num_tokens: int


class _Turn(NamedTuple):
    arrival_s: float
    segments: tuple[_Segment, ...]
    output_length: int


class _Session:
    """Draws sessions one after the other from one random stream."""

    def __init__(self, config: GeneratorConfig, seed: int) -> None:
        # String seeds are hashed with SHA-512 by ``random``: stable across runs and versions.
        self.rng = random.Random(f"kvroute-generated-trace:{seed}")
        self.config = config
        weights = [k**-config.family_zipf for k in range(1, config.num_families + 1)]
        self.family_cum = list(itertools.accumulate(weights))
        # Family prefixes have uids -1, -2, ...; every other segment a fresh uid from 0.
        self.family_len = [config.family_tokens.draw(self.rng) for _ in weights]
        self.next_uid = itertools.count()
        self.start_s = 0.0

    def _segment(self, num_tokens: int) -> _Segment:
        return _Segment(next(self.next_uid), num_tokens)

    def _num_turns(self) -> int:
        # Geometric on {1, 2, ...} with mean ``mean_turns``.
        p = 1.0 / self.config.mean_turns
        if p >= 1.0:
            return 1
        extra = int(math.log(1.0 - self.rng.random()) / math.log(1.0 - p))
        return min(self.config.max_turns, 1 + extra)

    def next_session(self) -> list[_Turn]:
        """The next session's turns, in arrival order; its start follows the previous one's."""
        config, rng = self.config, self.rng
        history: list[_Segment] = []
        if rng.random() < config.family_fraction:
            family = bisect.bisect_left(self.family_cum, rng.random() * self.family_cum[-1])
            history.append(_Segment(-1 - family, self.family_len[family]))
        context = config.context_tokens.draw(rng)
        if context:
            history.append(self._segment(context))
        turns: list[_Turn] = []
        arrival_s = self.start_s
        for turn in range(self._num_turns()):
            if turn and config.think_time_s:
                arrival_s += rng.expovariate(1.0 / config.think_time_s)
            history.append(self._segment(config.user_tokens.draw(rng)))
            output = config.output_tokens.draw(rng)
            turns.append(_Turn(arrival_s, tuple(history), output))
            history.append(self._segment(output))
        session_rate = config.requests_per_s / config.mean_turns
        self.start_s += rng.expovariate(session_rate)
        return turns


def _first_turns(config: GeneratorConfig, num_requests: int, seed: int) -> list[_Turn]:
    """The first ``num_requests`` turns to arrive, over every session that could hold one."""
    sessions = _Session(config, seed)
    turns: list[_Turn] = []
    latest: list[float] = []  # max-heap (negated) of the num_requests earliest arrivals
    # A session starting after the num_requests-th earliest arrival cannot change the set.
    while len(latest) < num_requests or sessions.start_s <= -latest[0]:
        for turn in sessions.next_session():
            turns.append(turn)
            heapq.heappush(latest, -turn.arrival_s)
            if len(latest) > num_requests:
                heapq.heappop(latest)
    # The sort is stable: equal arrivals keep session order, so the result is deterministic.
    turns.sort(key=lambda t: t.arrival_s)
    return turns[:num_requests]


def _blocks(segments: Sequence[_Segment]) -> Iterator[tuple[tuple[int, int, int], ...]]:
    """Each 512-token block of a prompt as its pieces ``(segment uid, start, end)``."""
    pieces: list[tuple[int, int, int]] = []
    room = TRACE_BLOCK_TOKENS
    for segment in segments:
        start = 0
        while start < segment.num_tokens:
            end = min(segment.num_tokens, start + room)
            pieces.append((segment.uid, start, end))
            room -= end - start
            start = end
            if room == 0:
                yield tuple(pieces)
                pieces, room = [], TRACE_BLOCK_TOKENS
    if pieces:
        yield tuple(pieces)


def generate_trace(
    num_requests: int, config: GeneratorConfig | None = None, seed: int = 0
) -> list[TraceRecord]:
    """The first ``num_requests`` requests of the generated workload, as trace records.

    Args:
        num_requests: Requests to return; a larger count returns a longer trace whose
            first ``num_requests`` records are these (same timestamps, lengths and ids).
        config: The workload's statistics (``None``: the defaults).
        seed: Seed of every random draw; the trace is a pure function of the arguments.

    Returns:
        Records in arrival order, timestamps in ms from 0.

    Raises:
        WorkloadError: ``num_requests`` is not positive.
    """
    if num_requests <= 0:
        raise WorkloadError(f"num_requests must be positive, got {num_requests}")
    turns = _first_turns(config or GeneratorConfig(), num_requests, seed)
    ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}
    start_s = turns[0].arrival_s
    records: list[TraceRecord] = []
    for turn in turns:
        hash_ids: list[int] = []
        parent = -1
        for pieces in _blocks(turn.segments):
            # Chained like a real trace: a block's id depends on its parent's.
            parent = ids.setdefault((parent, pieces), len(ids))
            hash_ids.append(parent)
        records.append(
            TraceRecord(
                timestamp=round((turn.arrival_s - start_s) * 1000),
                input_length=sum(s.num_tokens for s in turn.segments),
                output_length=turn.output_length,
                hash_ids=hash_ids,
            )
        )
    return records
