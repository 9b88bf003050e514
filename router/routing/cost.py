"""The routing cost model: what sending one request to one worker costs, in tokens of work.

A candidate's score is the prefill work it would do for the request (prompt tokens minus
the prefix it already caches, CPU-tier blocks saving only a fraction of theirs) plus the
work already waiting on it (queued prefill tokens, decode tokens in flight, a fixed cost
per in-flight request), each with a weight. Lower is better. There is no threshold at
which the cache stops counting: a cached prefix is always worth exactly the tokens it
saves, and load always costs what it delays.

Computed tokens weigh more than queued ones (``prefill`` > ``queued_prefill``): a prefix
computed a second time costs the cluster that work again and the cache room of a copy, so
a family of requests should stay where its prefix is. Except for a prefix that several
workers already hold (``replicated_holders``): that is a shared prefix such as a system
prompt, whose copies are meant to spread, so a worker lacking it pays only the
``replicated_prefill`` weight to compute it. That settles the shared-system-prompt case:
a prefix every worker caches lowers every score by the same amount and attracts nothing;
a prefix a few workers cache costs the others little to acquire, so affinity to it never
piles the traffic on the few.

Everything here is pure: no clock, no I/O; randomness comes from the caller's generator.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from router.errors import RouterError
from router.load.model import WorkerLoad

__all__ = [
    "CostBreakdown",
    "CostConfigError",
    "CostWeights",
    "choose",
    "replicated_blocks",
    "score_candidate",
    "score_candidates",
]


class CostConfigError(RouterError, ValueError):
    """A cost weight or the temperature is out of range."""


@dataclass(frozen=True, slots=True)
class CostWeights:
    """Weights of the cost model; every term is in tokens of prefill work.

    Attributes:
        prefill: Per prompt token the candidate would compute for this request. Well
            above ``queued_prefill``: a queued token only delays this request, while a
            computed token also delays every request queued behind it later, and a prefix
            computed twice takes cache room from other prefixes. Measured in the simulator
            (8 workers x 5,859 blocks, other weights at their defaults): prefill weights
            1, 2, 4, 8 reach 94.5, 98.4, 99.3, 99.5 % of the infinite-cache hit rate on
            the Mooncake synthetic trace and 83.9, 88.2, 92.0, 94.4 % on its conversation
            trace, with max/mean load <= 1.16 and TTFT within 3 %; at 3x speed
            (overload) 8 also cuts TTFT p50 from 39.5 s (weight 1) to 24.1 s.
        queued_prefill: Per prompt token already queued on the candidate.
        replicated_prefill: Per prompt token the candidate would compute that at least
            ``replicated_holders`` other candidates already cache (instead of ``prefill``).
        replicated_holders: How many other holders make a prefix block "replicated"
            (shared by design); at least 1.
        decode: Per output token still to be generated on the candidate (decode shares
            the accelerator with prefill, so it delays this request too).
        per_request: Fixed cost per request in flight on the candidate (scheduling and
            memory pressure that token counts miss).
        cpu_hit: Fraction of a CPU-tier cached token's prefill that is saved (loading it
            back is cheaper than computing it, but not free); GPU-tier tokens save 1.
        temperature: 0 picks the lowest score. Above 0, candidates are sampled with
            probability proportional to ``exp(-(score - best) / (temperature * prompt))``:
            a candidate whose cost exceeds the best by ``temperature`` times the prompt
            length is ``e`` times less likely than the best.
    """

    prefill: float = 8.0
    queued_prefill: float = 1.0
    replicated_prefill: float = 1.0
    replicated_holders: int = 2
    decode: float = 1.0
    per_request: float = 256.0
    cpu_hit: float = 0.5
    temperature: float = 0.0

    def __post_init__(self) -> None:
        names = ("prefill", "queued_prefill", "replicated_prefill", "decode", "per_request")
        for name in (*names, "temperature"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise CostConfigError(f"cost weight {name} must be finite and >= 0, got {value}")
        if self.replicated_holders < 1:
            raise CostConfigError(f"replicated_holders must be >= 1, got {self.replicated_holders}")
        if not 0.0 <= self.cpu_hit <= 1.0:
            raise CostConfigError(f"cost weight cpu_hit must be in [0, 1], got {self.cpu_hit}")


# A msgspec Struct, not a frozen dataclass: one per candidate per decision (64 at 64
# workers), ~0.15 us apiece against ~1 us (bench_router).
class CostBreakdown(msgspec.Struct, frozen=True, gc=False):
    """One candidate's score and the terms it is made of (all in tokens, unweighted).

    NOTE: ``score`` is exactly the weighted sum of :meth:`terms` under the weights it was
    scored with, summed in that order.

    Attributes:
        cached_tokens: Prompt tokens counted as cached (CPU tier already weighted), at
            most ``prompt - 1`` since an engine always computes the last prompt token.
        prefill_tokens: Prompt tokens the candidate would compute for this request.
        replicated_tokens: Those of them that other candidates already cache widely
            (charged at ``replicated_prefill``).
        queued_prefill_tokens: Prefill already queued on the candidate.
        decode_tokens: Decode tokens in flight on the candidate.
        num_requests: Requests in flight on the candidate.
        score: The weighted sum; lower is better.
        credited_tokens: Prompt tokens predicted entries alone credit the candidate with
            (``cached_tokens`` is the larger of these and its event-backed prefix); kept
            so that ``kvroute explain`` can re-make the decision from a decision log.
    """

    cached_tokens: float
    prefill_tokens: float
    replicated_tokens: float
    queued_prefill_tokens: int
    decode_tokens: int
    num_requests: int
    score: float
    credited_tokens: int = 0

    def terms(self, weights: CostWeights) -> tuple[tuple[str, float, float], ...]:
        """Each term of :attr:`score` as ``(name, tokens, weight)``, in summation order."""
        return (
            ("compute", self.prefill_tokens - self.replicated_tokens, weights.prefill),
            ("replicated", self.replicated_tokens, weights.replicated_prefill),
            ("queued", float(self.queued_prefill_tokens), weights.queued_prefill),
            ("decode", float(self.decode_tokens), weights.decode),
            ("requests", float(self.num_requests), weights.per_request),
        )


def score_candidates(
    num_prompt_tokens: int,
    cached_tokens: Sequence[float],
    replicated_tokens: Sequence[float],
    loads: Sequence[WorkerLoad],
    weights: CostWeights,
    credited_tokens: Sequence[int] | None = None,
) -> list[CostBreakdown]:
    """Score sending a request to each of several candidates (the one scoring loop).

    Args:
        num_prompt_tokens: The request's prompt length.
        cached_tokens: Per candidate, tokens of its prefix it holds (CPU tier weighted,
            e.g. by ``PrefixMatch.weighted_tokens(block_size, weights.cpu_hit)``).
        replicated_tokens: Per candidate, tokens of the prompt beyond its cached prefix
            that at least ``weights.replicated_holders`` other candidates cache (see
            :func:`replicated_blocks`).
        loads: Per candidate, its outstanding work.
        weights: The cost weights.
        credited_tokens: Per candidate, the part of ``cached_tokens`` predicted entries
            credit (recorded in the breakdown only); ``None``: all 0.

    Returns:
        One breakdown per candidate, in the order given.
    """
    # One fused loop with the weights in locals: this runs per candidate per decision
    # (64 candidates at 64 workers; bench_router "pure decide" row).
    top = num_prompt_tokens - 1 if num_prompt_tokens > 1 else 0
    w_prefill, w_replicated = weights.prefill, weights.replicated_prefill
    w_queued, w_decode, w_request = weights.queued_prefill, weights.decode, weights.per_request
    credited = credited_tokens if credited_tokens is not None else [0] * len(loads)
    out = []
    for cached, shared, load, credit in zip(
        cached_tokens, replicated_tokens, loads, credited, strict=True
    ):
        # Conditionals and "+ 0.0", not min/max/float calls: each call costs more than
        # the arithmetic here.
        if cached > top:
            cached = top + 0.0
        elif cached < 0:
            cached = 0.0
        prefill = num_prompt_tokens - cached
        if shared > prefill:
            shared = prefill
        elif shared > 0:
            shared += 0.0
        else:
            shared = 0.0
        queued = load.queued_prefill_tokens
        decode = load.decode_tokens
        requests = load.num_requests
        score = (
            w_prefill * (prefill - shared)
            + w_replicated * shared
            + w_queued * queued
            + w_decode * decode
            + w_request * requests
        )
        out.append(
            CostBreakdown(cached + 0.0, prefill, shared, queued, decode, requests, score, credit)
        )
    return out


def score_candidate(
    num_prompt_tokens: int,
    cached_tokens: float,
    load: WorkerLoad,
    weights: CostWeights,
    replicated_tokens: float = 0.0,
) -> CostBreakdown:
    """Score sending a request to one candidate (:func:`score_candidates` of one).

    Args:
        num_prompt_tokens: The request's prompt length.
        cached_tokens: Tokens of its prefix the candidate holds (CPU tier weighted).
        load: The candidate's outstanding work.
        weights: The cost weights.
        replicated_tokens: Tokens of the prompt beyond the candidate's cached prefix that
            at least ``weights.replicated_holders`` other candidates cache.

    Returns:
        The score and its terms.
    """
    return score_candidates(
        num_prompt_tokens, [cached_tokens], [replicated_tokens], [load], weights
    )[0]


def replicated_blocks(prefix_blocks: Sequence[int], holders: int) -> list[int]:
    """Per candidate, the blocks beyond its own prefix that ``holders`` others hold.

    Block ``i`` counts for candidate ``c`` when ``c`` lacks it and at least ``holders``
    other candidates' prefixes reach past it, i.e. ``i`` is below the ``holders``-th
    longest prefix (a candidate among the ``holders`` longest gets 0).

    Args:
        prefix_blocks: Each candidate's cached prefix length in blocks.
        holders: The replication threshold (``CostWeights.replicated_holders``).
    """
    ranked = sorted(prefix_blocks, reverse=True)
    if len(ranked) < holders:
        return [0] * len(prefix_blocks)
    line = ranked[holders - 1]
    return [line - n if n < line else 0 for n in prefix_blocks]  # no max(): per candidate


def choose(
    scores: Sequence[float],
    *,
    temperature: float,
    scale: float,
    rng: random.Random | None = None,
    tie_break: int = 0,
) -> int:
    """Index of the candidate to route to.

    Args:
        scores: One score per candidate; lower is better. Must not be empty.
        temperature: 0 for the lowest score; see :attr:`CostWeights.temperature`.
        scale: Tokens the temperature is relative to (the request's prompt length).
        rng: Randomness for sampling (seeded by the caller for reproducible runs);
            required when ``temperature > 0``.
        tie_break: With ``temperature == 0``, which of several equal best scores wins
            (``tie_break`` modulo their number), so a caller that rotates it spreads ties
            instead of always favouring the first candidate.

    Returns:
        An index into ``scores``.
    """
    assert scores, "choose() needs at least one candidate"
    best = min(scores)
    if temperature > 0:
        assert rng is not None, "sampling with a temperature needs a generator"
        width = temperature * max(scale, 1.0)
        weights = [math.exp(-(s - best) / width) for s in scores]
        return rng.choices(range(len(scores)), weights=weights)[0]
    ties = [i for i, s in enumerate(scores) if s == best]
    return ties[tie_break % len(ties)]
