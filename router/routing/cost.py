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

What keeps families from piling up on a few workers is the fair-share term
(``fair_share``): a worker whose share of the recent requests or computed tokens would
exceed ``balance_factor`` times the mean pays for the excess, so the requests that are
cheap to move (new families of a popular prefix) move, long private prefixes stay, and the
workers' caches churn evenly, as one pooled cache would.

Everything here is pure: no clock, no I/O; randomness comes from the caller's generator.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from router.errors import RouterError
from router.load.model import WorkerLoad

__all__ = [
    "PRIOR_REQUESTS",
    "CostBreakdown",
    "CostConfigError",
    "CostWeights",
    "RecentWork",
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
            computed twice takes cache room from other prefixes, which costs hits later
            once the working set outgrows the cluster's cache. Measured in the simulator
            (8 workers x 5,859 blocks, other weights at their defaults, before the
            fair-share term): prefill weights 1, 2, 4, 8 reach 94.5, 98.4, 99.3, 99.5 % of
            the infinite-cache hit rate on the Mooncake synthetic trace and 83.9, 88.2,
            92.0, 94.4 % on its conversation trace (working set 3.9x the cache), with
            max/mean load <= 1.16 and TTFT within 3 %; at 3x speed (overload) 8 also cuts
            TTFT p50 from 39.5 s (weight 1) to 24.1 s. With the fair-share term keeping
            the load even, the weight no longer has to trade hits for balance: on the
            conversation trace 8, 16, 32, 64 reach 0.974, 0.989, 0.998, 1.000 of the
            pooled-LRU bound (:mod:`router.sim.bounds`) at max/mean load <= 1.05 and mean
            TTFT 0.97, 1.00, 1.02, 1.05 s (``benchmarks/RESULTS.md``, bench_sim capacity).
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
        fair_share: Prompt tokens (charged at ``prefill``; fewer for a shorter prompt: its
            own length) a candidate pays per unit by which its recent share of the
            cluster's requests, and of its computed tokens, would exceed
            ``balance_factor`` times the mean with this request (see
            :attr:`CostBreakdown.excess_share`); 0 turns the term off. A request moves off an
            over-served worker when that costs less than the term: new families of a
            popular prefix (a copy of the shared part) move first, long private prefixes
            stay. Keeping recent computed tokens even also keeps every worker's cache as
            old as one pooled LRU cache would be, so fewer reused blocks are evicted.
        balance_factor: Share of the mean (>= 1) that a worker may reach before the
            fair-share term charges it.
        fair_share_half_life_s: Age at which a routed request counts half in the recent
            shares.
    """

    prefill: float = 32.0
    queued_prefill: float = 1.0
    replicated_prefill: float = 1.0
    replicated_holders: int = 2
    decode: float = 1.0
    per_request: float = 256.0
    cpu_hit: float = 0.5
    temperature: float = 0.0
    fair_share: float = 2048.0
    balance_factor: float = 1.1
    fair_share_half_life_s: float = 60.0

    def __post_init__(self) -> None:
        names = (
            "prefill",
            "queued_prefill",
            "replicated_prefill",
            "decode",
            "per_request",
            "fair_share",
        )
        for name in (*names, "temperature"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise CostConfigError(f"cost weight {name} must be finite and >= 0, got {value}")
        if self.replicated_holders < 1:
            raise CostConfigError(f"replicated_holders must be >= 1, got {self.replicated_holders}")
        if not 0.0 <= self.cpu_hit <= 1.0:
            raise CostConfigError(f"cost weight cpu_hit must be in [0, 1], got {self.cpu_hit}")
        if not (math.isfinite(self.balance_factor) and self.balance_factor >= 1.0):
            raise CostConfigError(f"balance_factor must be >= 1, got {self.balance_factor}")
        if not (math.isfinite(self.fair_share_half_life_s) and self.fair_share_half_life_s > 0):
            raise CostConfigError(
                f"fair_share_half_life_s must be > 0, got {self.fair_share_half_life_s}"
            )


class RecentWork(msgspec.Struct, frozen=True, gc=False):
    """One worker's recent work, each request counted with weight ``2 ** (-age / half_life)``
    (:class:`router.routing.share.WorkShares` keeps it; the fair-share term reads it).

    Attributes:
        requests: Requests routed to it.
        prefill_tokens: Prompt tokens it was expected to compute for them.
    """

    requests: float = 0.0
    prefill_tokens: float = 0.0


_IDLE_WORK: Final = RecentWork()


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
        recent_requests: The candidate's recent requests (:mod:`router.routing.share`),
            the input of ``excess_share``, kept for the same reason.
        recent_prefill_tokens: Its recent prefill tokens, likewise.
        excess_share: By how much its recent shares would exceed ``balance_factor`` with
            this request routed to it, each worker credited with :data:`PRIOR_REQUESTS`
            typical requests: ``max(0, (requests + 1 + PRIOR) / (R / n + PRIOR) - b)`` over
            the ``R`` recent requests (this one included) of ``n`` candidates, plus the
            same for computed tokens, ``max(0, (tokens + x + PRIOR * T / R) / (T / n +
            PRIOR * T / R) - b)`` with ``x`` this request's prefill and ``T`` all recent
            prefill tokens with it, weighed by ``x / (T / R)``: what the request adds in
            typical requests. So a request that hits a long prefix on an over-served
            worker adds little work there and is charged little, while a long prompt
            nobody caches goes to a worker below its share. Charged at ``prefill`` times
            :meth:`share_unit`.
        session_tokens: Prompt tokens credited to the worker that served the request's
            session last (:mod:`router.routing.sessions`), as if cached: charged at
            ``-prefill``, so it wins ties and loses to real load.
    """

    cached_tokens: float
    prefill_tokens: float
    replicated_tokens: float
    queued_prefill_tokens: int
    decode_tokens: int
    num_requests: int
    score: float
    credited_tokens: int = 0
    recent_requests: float = 0.0
    recent_prefill_tokens: float = 0.0
    excess_share: float = 0.0
    session_tokens: int = 0

    def terms(self, weights: CostWeights) -> tuple[tuple[str, float, float], ...]:
        """Each term of :attr:`score` as ``(name, amount, weight)``, in summation order."""
        return (
            ("compute", self.prefill_tokens - self.replicated_tokens, weights.prefill),
            ("replicated", self.replicated_tokens, weights.replicated_prefill),
            ("queued", float(self.queued_prefill_tokens), weights.queued_prefill),
            ("decode", float(self.decode_tokens), weights.decode),
            ("requests", float(self.num_requests), weights.per_request),
            ("share", self.excess_share, weights.prefill * self.share_unit(weights)),
            ("session", -float(self.session_tokens), weights.prefill),
        )

    def share_unit(self, weights: CostWeights) -> float:
        """Prompt tokens one unit of :attr:`excess_share` costs (before ``prefill``): the
        prompt, up to ``weights.fair_share``."""
        prompt = round(self.cached_tokens + self.prefill_tokens)  # both from the prompt
        return weights.fair_share if weights.fair_share < prompt else prompt


PRIOR_REQUESTS: Final = 8.0
"""Pseudo-requests every worker is credited with before recent shares are compared, so
that a handful of requests (a quiet cluster, a router just started) never reads as an
imbalance: a deviation counts only once it exceeds what chance gives over ~8 requests."""


def score_candidates(
    num_prompt_tokens: int,
    cached_tokens: Sequence[float],
    replicated_tokens: Sequence[float],
    loads: Sequence[WorkerLoad],
    weights: CostWeights,
    credited_tokens: Sequence[int] | None = None,
    recent: Sequence[RecentWork] | None = None,
    session_tokens: Sequence[int] | None = None,
    num_candidates: int | None = None,
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
        recent: Per candidate, its recent work, for the fair-share term; ``None``: no
            such term (as with ``weights.fair_share == 0``).
        session_tokens: Per candidate, its session-affinity credit in tokens; ``None``:
            all 0.
        num_candidates: How many candidates the decision has (default: those given);
            more when the others were left out because they are idle, hold nothing and
            did no recent work, as the fair-share term counts them all.

    Returns:
        One breakdown per candidate, in the order given.
    """
    # One fused loop with the weights in locals: this runs per candidate per decision
    # (64 candidates at 64 workers; bench_router "pure decide" row).
    top = num_prompt_tokens - 1 if num_prompt_tokens > 1 else 0
    w_prefill, w_replicated = weights.prefill, weights.replicated_prefill
    w_queued, w_decode, w_request = weights.queued_prefill, weights.decode, weights.per_request
    credited = credited_tokens if credited_tokens is not None else [0] * len(loads)
    sessions = session_tokens if session_tokens is not None else [0] * len(loads)
    # The share unit is this request's prompt, up to fair_share tokens: moving a short
    # prompt off its prefix saves little balance, and a long one stays sticky.
    unit = weights.fair_share if weights.fair_share < num_prompt_tokens else num_prompt_tokens
    w_share = weights.prefill * unit
    works: Sequence[RecentWork] = recent if recent is not None else [_IDLE_WORK] * len(loads)
    total_requests = sum([r.requests for r in works]) if recent is not None else 0.0
    count = len(loads) if num_candidates is None else num_candidates
    # Without any recent work (no record kept, or none yet) there is nothing to balance.
    fair = w_share > 0 and count > 1 and total_requests > 0
    # Fair-share constants (see CostBreakdown.excess_share): with this request routed,
    # requests R = total + 1; the mean share of requests is R / n + PRIOR, and of tokens
    # T * k where T = total tokens + this candidate's prefill and k = 1 / n + PRIOR / R.
    balance = weights.balance_factor
    requests_after = total_requests + 1
    total_tokens = sum([r.prefill_tokens for r in works]) if fair else 0.0
    mean_requests = requests_after / count + PRIOR_REQUESTS
    per_token_mean = 1 / count + PRIOR_REQUESTS / requests_after
    prior_per_token = PRIOR_REQUESTS / requests_after
    out = []
    for cached, shared, load, credit, work, session in zip(
        cached_tokens, replicated_tokens, loads, credited, works, sessions, strict=True
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
        excess = 0.0
        if fair:
            by_requests = (work.requests + 1 + PRIOR_REQUESTS) / mean_requests - balance
            if by_requests > 0:
                excess = by_requests
            after = total_tokens + prefill
            if after > 0:
                by_tokens = (work.prefill_tokens + prefill + prior_per_token * after) / (
                    after * per_token_mean
                ) - balance
                if by_tokens > 0:  # weighed by what this request adds, in typical requests
                    excess += by_tokens * prefill * requests_after / after
        score = (
            w_prefill * (prefill - shared)
            + w_replicated * shared
            + w_queued * queued
            + w_decode * decode
            + w_request * requests
            + w_share * excess
            - w_prefill * session
        )
        out.append(
            CostBreakdown(
                cached + 0.0,
                prefill,
                shared,
                queued,
                decode,
                requests,
                score,
                credit,
                work.requests,
                work.prefill_tokens,
                excess,
                session,
            )
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


def replicated_blocks(
    prefix_blocks: Sequence[int], holders: int, num_candidates: int | None = None
) -> list[int]:
    """Per candidate, the blocks beyond its own prefix that ``holders`` others hold.

    Block ``i`` counts for candidate ``c`` when ``c`` lacks it and at least ``holders``
    other candidates' prefixes reach past it, i.e. ``i`` is below the ``holders``-th
    longest prefix (a candidate among the ``holders`` longest gets 0).

    Args:
        prefix_blocks: Each candidate's cached prefix length in blocks.
        holders: The replication threshold (``CostWeights.replicated_holders``).
        num_candidates: How many candidates there are (default: those given); the
            others hold 0 blocks.
    """
    ranked = sorted(prefix_blocks, reverse=True)
    if (len(ranked) if num_candidates is None else num_candidates) < holders:
        return [0] * len(prefix_blocks)
    line = ranked[holders - 1] if holders <= len(ranked) else 0
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
