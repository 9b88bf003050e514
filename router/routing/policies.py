"""Routing policies: given a request and its candidate workers, pick one and say why.

Every policy implements :class:`RoutingPolicy`: ``decide(request, candidates)`` does no
I/O (the caller looks up the index, the predicted entries and the loads first, see
:func:`build_candidates`) and returns a :class:`Decision` that lists, per candidate, the
matched tokens, the predicted tokens, the load and the score the policy gave it. Policies
that rotate or sample keep that state themselves (a counter, a seeded generator), so a
run is reproducible. ``cache_aware`` is the default; the others are the baselines that
every benchmark reports against.
"""

from __future__ import annotations

import bisect
import math
import operator
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import msgspec
import xxhash

from events.hashing import BlockKey
from events.identity import WorkerId
from router.index.base import PrefixMatch
from router.load.model import WorkerLoad
from router.routing.cost import (
    CostBreakdown,
    CostConfigError,
    CostWeights,
    RecentWork,
    choose,
    replicated_blocks,
    score_candidates,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Candidate",
    "CandidateScore",
    "Decision",
    "PolicyConfig",
    "RouteRequest",
    "RoutingPolicy",
    "build_candidates",
    "make_policy",
]

DEFAULT_POLICY: Final = "cache_aware"


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy knows about a request.

    Attributes:
        keys: Router keys of the prompt's full blocks, from block 0.
        num_prompt_tokens: Prompt length in tokens.
        block_size: Tokens per block of ``keys``.
        num_output_tokens: Expected output tokens (e.g. ``max_tokens``), for decode load.
    """

    keys: Sequence[BlockKey]
    num_prompt_tokens: int
    block_size: int
    num_output_tokens: int = 0


# Candidate and CandidateScore are msgspec Structs, not frozen dataclasses: 64 of each per
# decision at 64 workers, ~0.1 us apiece against ~1 us (bench_router).
class Candidate(msgspec.Struct, frozen=True, gc=False):
    """A worker the request may go to, with what the router knows about it.

    Attributes:
        worker_id: The worker.
        load: Its outstanding work.
        match: The prefix its own events confirm it caches.
        num_predicted_blocks: The prefix it is credited with by predicted entries (or by
            the route history of ``approximate``); 0 when none.
        recent: Its recent work, for the fair-share term of the cost-based policies.
        session_bonus_tokens: Prompt tokens cost-based policies credit it with, as if
            cached, because it served the request's session last
            (:mod:`router.routing.sessions`); 0 for every other candidate.
    """

    worker_id: WorkerId
    load: WorkerLoad = msgspec.field(default_factory=WorkerLoad)
    match: PrefixMatch = msgspec.field(default_factory=PrefixMatch)
    num_predicted_blocks: int = 0
    recent: RecentWork = msgspec.field(default_factory=RecentWork)
    session_bonus_tokens: int = 0


class CandidateScore(msgspec.Struct, frozen=True, gc=False):
    """How a policy saw one candidate.

    Attributes:
        worker_id: The candidate.
        matched_tokens: Prompt tokens its confirmed (event-backed) prefix covers.
        predicted_tokens: Prompt tokens covered counting predicted entries as well.
        load: Its load at decision time.
        score: The policy's score; for cost-based policies, tokens of work (lower wins).
    """

    worker_id: WorkerId
    matched_tokens: int
    predicted_tokens: int
    load: WorkerLoad
    score: float


_by_score = operator.attrgetter("score")


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing decision and its explanation.

    Attributes:
        worker_id: The chosen worker.
        policy: Name of the policy that chose it.
        candidates: Every candidate as the policy scored it, in the order given.
        prefill_tokens: Prompt tokens the chosen worker is expected to compute (what the
            caller adds to its queued prefill load).
        costs: For cost-based policies, each candidate's cost terms, in the order of
            ``candidates`` (``costs[i].score == candidates[i].score``); empty otherwise.
        weights: The cost weights ``costs`` were scored with; ``None`` without costs.
    """

    worker_id: WorkerId
    policy: str
    candidates: tuple[CandidateScore, ...]
    prefill_tokens: int
    costs: tuple[CostBreakdown, ...] = ()
    weights: CostWeights | None = None

    @property
    def chosen(self) -> CandidateScore:
        """The chosen candidate's entry of :attr:`candidates`."""
        return next(c for c in self.candidates if c.worker_id == self.worker_id)

    def costs_by_worker(self) -> dict[WorkerId, CostBreakdown]:
        """:attr:`costs` keyed by candidate; empty without costs."""
        if not self.costs:
            return {}
        return {c.worker_id: cost for c, cost in zip(self.candidates, self.costs, strict=True)}

    def ranked(self) -> tuple[CandidateScore, ...]:
        """The candidates best first: the chosen one, then the others by score.

        Ties keep the order given (the sort is stable): the order to fall back in when
        the chosen worker fails.
        """
        chosen = self.worker_id
        rest = sorted((c for c in self.candidates if c.worker_id != chosen), key=_by_score)
        return (self.chosen, *rest)


class RoutingPolicy(Protocol):
    """A way of choosing a worker.

    Attributes:
        name: The policy's name, as given to :func:`make_policy`.
        uses_index: Whether ``decide`` reads ``Candidate.match`` (else the caller may
            skip the index lookup).
        credit_ttl_s: How long the caller should credit the chosen worker with the
            request's keys (:class:`router.routing.predicted.PredictedEntries`) and report them
            in ``Candidate.num_predicted_blocks``; 0 when the policy ignores them.
    """

    name: str
    uses_index: bool
    credit_ttl_s: float

    def decide(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Choose one of ``candidates`` (not empty) for ``request``."""
        ...


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Settings of every policy; each reads the fields it needs.

    Attributes:
        weights: Cost model weights (``cache_aware``, ``approximate``).
        seed: Seed of sampling (``random``, softmax temperature).
        predicted_ttl_s: Lifetime of predicted entries for ``cache_aware``; must cover
            queueing plus prefill, after which the worker's ``BlockStored`` takes over.
        history_ttl_s: Lifetime of the route history of ``approximate``.
        hash_prefix_blocks: ``consistent_hash`` hashes the key of this many leading
            blocks (fewer when the prompt is shorter). 2 rather than 1 so a system prompt
            of one block that every request shares does not map them all to one worker
            (measured in the simulator: ``docs/simulator.md``, "Consistent hashing").
        hash_load_factor: ``consistent_hash`` skips workers whose in-flight requests
            exceed this factor times the mean (bounded-load consistent hashing).
        hash_vnodes: Points per worker on the ``consistent_hash`` ring.
    """

    weights: CostWeights = field(default_factory=CostWeights)
    seed: int = 0
    predicted_ttl_s: float = 30.0
    history_ttl_s: float = 600.0
    hash_prefix_blocks: int = 2
    hash_load_factor: float = 1.25
    hash_vnodes: int = 64

    def __post_init__(self) -> None:
        if not (self.predicted_ttl_s > 0 and self.history_ttl_s > 0):
            raise CostConfigError("predicted_ttl_s and history_ttl_s must be > 0")
        if self.hash_prefix_blocks < 1 or self.hash_vnodes < 1:
            raise CostConfigError("hash_prefix_blocks and hash_vnodes must be >= 1")
        if not self.hash_load_factor >= 1.0:
            raise CostConfigError(f"hash_load_factor must be >= 1, got {self.hash_load_factor}")


def build_candidates(
    workers: Sequence[WorkerId],
    loads: Mapping[WorkerId, WorkerLoad],
    matches: Mapping[WorkerId, PrefixMatch] | None = None,
    predicted: Mapping[WorkerId, int] | None = None,
    recent: Mapping[WorkerId, RecentWork] | None = None,
) -> list[Candidate]:
    """Join what the caller looked up into one :class:`Candidate` per worker.

    Args:
        workers: The candidate workers, in a stable order.
        loads: Their loads (absent: idle).
        matches: Index lookup result (absent worker: no match).
        predicted: Predicted prefix lengths (absent worker: none).
        recent: Their recent work (absent worker: none).

    Returns:
        The candidates, in the order of ``workers``.
    """
    no_match = PrefixMatch()
    idle = WorkerLoad()
    none = RecentWork()
    matches = matches or {}
    predicted = predicted or {}
    recent = recent or {}
    return [
        Candidate(
            w,
            loads.get(w, idle),
            matches.get(w, no_match),
            predicted.get(w, 0),
            recent.get(w, none),
        )
        for w in workers
    ]


def _explain(
    request: RouteRequest, candidates: Sequence[Candidate], scores: Sequence[float]
) -> tuple[CandidateScore, ...]:
    bs, limit = request.block_size, request.num_prompt_tokens
    explained = []
    for c, s in zip(candidates, scores, strict=True):
        matched = c.match.num_blocks * bs
        predicted = c.num_predicted_blocks * bs
        if predicted < matched:
            predicted = matched
        explained.append(
            CandidateScore(
                c.worker_id,
                matched if matched < limit else limit,
                predicted if predicted < limit else limit,
                c.load,
                s,
            )
        )
    return tuple(explained)


def _decision(
    policy: str,
    request: RouteRequest,
    candidates: Sequence[Candidate],
    scores: Sequence[float],
    index: int,
    prefill_tokens: int | None = None,
    costs: Sequence[CostBreakdown] = (),
    weights: CostWeights | None = None,
) -> Decision:
    explained = _explain(request, candidates, scores)
    if prefill_tokens is None:
        prefill_tokens = request.num_prompt_tokens - explained[index].predicted_tokens
    return Decision(
        candidates[index].worker_id,
        policy,
        explained,
        max(prefill_tokens, 0),
        tuple(costs),
        weights,
    )


class CostPolicy:
    """Lowest cost in tokens of work (:mod:`router.routing.cost`).

    ``cache_aware`` counts a candidate's cached prefix as the longer of what its events
    confirm and what predicted entries credit it with; ``approximate`` sees no events
    and counts only its own route history.
    """

    def __init__(self, name: str, config: PolicyConfig, *, uses_index: bool) -> None:
        self.name = name
        self.uses_index = uses_index
        self.credit_ttl_s = config.predicted_ttl_s if uses_index else config.history_ttl_s
        self._weights = config.weights
        self._rng = random.Random(config.seed)
        self._turn = 0

    @property
    def samples(self) -> bool:
        """Whether it samples near-best candidates (a temperature above 0)."""
        return self._weights.temperature > 0

    def _costs(
        self, request: RouteRequest, candidates: Sequence[Candidate], num_candidates: int
    ) -> list[CostBreakdown]:
        """The cost of each of ``candidates``, among ``num_candidates`` in all (the others
        idle, holding nothing, without recent work)."""
        weights = self._weights
        bs = request.block_size
        credited = [c.num_predicted_blocks * bs for c in candidates]
        if self.uses_index:
            cpu_hit = weights.cpu_hit
            blocks: list[int] = []
            cached: list[float] = []
            for c, credit in zip(candidates, credited, strict=True):
                match, predicted = c.match, c.num_predicted_blocks
                if match.num_blocks:  # most candidates match nothing: skip the float work
                    confirmed = match.weighted_tokens(bs, cpu_hit)
                    blocks.append(max(match.num_blocks, predicted))
                    cached.append(confirmed if confirmed > credit else float(credit))
                else:
                    blocks.append(predicted)
                    cached.append(float(credit))
        else:
            blocks = [c.num_predicted_blocks for c in candidates]
            cached = [float(t) for t in credited]
        replicated = replicated_blocks(blocks, weights.replicated_holders, num_candidates)
        return score_candidates(
            request.num_prompt_tokens,
            cached,
            [n * bs for n in replicated],
            [c.load for c in candidates],
            weights,
            credited,
            [c.recent for c in candidates] if weights.fair_share > 0 else None,
            [c.session_bonus_tokens for c in candidates],
            num_candidates,
        )

    def decide(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Choose the candidate with the lowest cost (or sample near-best ones)."""
        weights = self._weights
        costs = self._costs(request, candidates, len(candidates))
        scores = [c.score for c in costs]
        index = choose(
            scores,
            temperature=weights.temperature,
            scale=request.num_prompt_tokens,
            rng=self._rng,
            tie_break=self._turn,
        )
        self._turn += 1
        prefill = math.ceil(costs[index].prefill_tokens)
        return _decision(self.name, request, candidates, scores, index, prefill, costs, weights)

    def decide_sparse(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerId],
        special: Sequence[tuple[int, Candidate]],
    ) -> Decision:
        """:meth:`decide` on every worker of ``workers``, given only the candidates that
        differ from an idle worker holding nothing (``(position in workers, candidate)``,
        by position); the others are ``Candidate(worker_id)``.

        The same decision as :meth:`decide` on all of them, scoring the others once: they
        all cost the same. Costs O(special candidates) but for building the decision's
        list of every candidate. Not for a policy that :attr:`samples`.
        """
        assert not self.samples, "sampling draws over every candidate: use decide()"
        n = len(workers)
        positions = [pos for pos, _ in special]
        scored = [c for _, c in special]
        num_plain = n - len(special)
        if num_plain:  # one stands for them all
            taken = set(positions)
            scored.append(Candidate(next(w for i, w in enumerate(workers) if i not in taken)))
        costs = self._costs(request, scored, n)
        scores = [c.score for c in costs]
        best = min(scores)
        ties = [pos for pos, score in zip(positions, scores, strict=False) if score == best]
        plain_ties = num_plain if num_plain and scores[-1] == best else 0
        nth = self._turn % (len(ties) + plain_ties)
        self._turn += 1
        index = _nth_tie(nth, ties, positions) if plain_ties else ties[nth]
        explained = list(_explain(request, scored, scores))
        out_costs = list(costs)
        if num_plain:
            plain, plain_cost = explained.pop(), out_costs.pop()
            load, score = plain.load, plain.score
            explained_all = [CandidateScore(w, 0, 0, load, score) for w in workers]
            costs_all = [plain_cost] * n
            for pos, entry, cost in zip(positions, explained, out_costs, strict=True):
                explained_all[pos] = entry
                costs_all[pos] = cost
            explained, out_costs = explained_all, costs_all
        return Decision(
            workers[index],
            self.name,
            tuple(explained),
            max(math.ceil(out_costs[index].prefill_tokens), 0),
            tuple(out_costs),
            self._weights,
        )


def _nth_tie(nth: int, ties: Sequence[int], special: Sequence[int]) -> int:
    """The ``nth`` (from 0) smallest position among ``ties`` and every position not in
    ``special`` (both sorted; ``ties`` within ``special``), by binary search."""
    lo, hi = 0, nth + len(special)  # the answer is at most nth + len(special)
    while lo < hi:
        mid = (lo + hi) // 2
        # Tie positions <= mid, plus the positions <= mid outside special.
        below = bisect.bisect_right(ties, mid) + mid + 1 - bisect.bisect_right(special, mid)
        if below > nth:
            hi = mid
        else:
            lo = mid + 1
    return lo


class RoundRobinPolicy:
    """Each candidate in turn, blind to cache and load."""

    name = "round_robin"
    uses_index = False
    credit_ttl_s = 0.0

    def __init__(self) -> None:
        self._turn = 0

    def decide(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The next candidate in turn."""
        index = self._turn % len(candidates)
        self._turn += 1
        return _decision(self.name, request, candidates, [0.0] * len(candidates), index)


class RandomPolicy:
    """A uniformly random candidate, from a seeded generator."""

    name = "random"
    uses_index = False
    credit_ttl_s = 0.0

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def decide(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """A random candidate."""
        index = self._rng.randrange(len(candidates))
        return _decision(self.name, request, candidates, [0.0] * len(candidates), index)


class LeastLoadedPolicy:
    """The candidate with the fewest requests in flight (ties rotate)."""

    name = "least_loaded"
    uses_index = False
    credit_ttl_s = 0.0

    def __init__(self) -> None:
        self._turn = 0

    def decide(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The least loaded candidate; score is its number of requests in flight."""
        scores = [float(c.load.num_requests) for c in candidates]
        index = choose(scores, temperature=0.0, scale=1.0, tie_break=self._turn)
        self._turn += 1
        return _decision(self.name, request, candidates, scores, index)


class ConsistentHashPolicy:
    """Bounded-load consistent hashing on the request's leading prefix key.

    Each worker owns ``hash_vnodes`` points of a 64-bit ring. A request goes to the first
    worker clockwise from its prefix key's point whose in-flight requests stay within
    ``ceil(hash_load_factor * mean)`` once it gets this one (Mirrokni et al., 2018).
    Prompts shorter than one block have no key and go to the least loaded candidate.
    """

    name = "consistent_hash"
    uses_index = False
    credit_ttl_s = 0.0

    def __init__(self, config: PolicyConfig) -> None:
        self._prefix_blocks = config.hash_prefix_blocks
        self._load_factor = config.hash_load_factor
        self._vnodes = config.hash_vnodes
        self._ring_of: tuple[WorkerId, ...] = ()
        self._points: list[int] = []
        self._owners: list[WorkerId] = []

    def _ring(self, workers: tuple[WorkerId, ...]) -> None:
        if workers == self._ring_of:
            return
        points = sorted(
            (xxhash.xxh3_64_intdigest(f"{w}#{v}".encode()), w)
            for w in workers
            for v in range(self._vnodes)
        )
        self._ring_of = workers
        self._points = [p for p, _ in points]
        self._owners = [w for _, w in points]

    def decide(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The prefix key's owner on the ring, or the next one with room."""
        workers = tuple(c.worker_id for c in candidates)
        position = {w: i for i, w in enumerate(workers)}
        in_flight = [c.load.num_requests for c in candidates]
        scores = [float(n) for n in in_flight]
        if not request.keys:
            index = min(range(len(candidates)), key=in_flight.__getitem__)
            return _decision(self.name, request, candidates, scores, index)
        self._ring(workers)
        key = request.keys[min(self._prefix_blocks, len(request.keys)) - 1]
        bound = math.ceil(self._load_factor * (sum(in_flight) + 1) / len(candidates))
        start = bisect.bisect_left(self._points, key)
        # NOTE: bound >= floor(mean) + 1 >= min(in_flight) + 1, so some worker has room.
        index = -1
        for step in range(len(self._points)):
            owner = position[self._owners[(start + step) % len(self._points)]]
            if in_flight[owner] + 1 <= bound:
                index = owner
                break
        assert index >= 0
        return _decision(self.name, request, candidates, scores, index)


POLICY_NAMES: Final = (
    "cache_aware",
    "approximate",
    "consistent_hash",
    "least_loaded",
    "random",
    "round_robin",
)


def make_policy(name: str, config: PolicyConfig | None = None) -> RoutingPolicy:
    """A fresh policy by name (one of :data:`POLICY_NAMES`).

    Raises:
        CostConfigError: The name is unknown.
    """
    config = config or PolicyConfig()
    if name == "cache_aware":
        return CostPolicy(name, config, uses_index=True)
    if name == "approximate":
        return CostPolicy(name, config, uses_index=False)
    if name == "consistent_hash":
        return ConsistentHashPolicy(config)
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "random":
        return RandomPolicy(config.seed)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise CostConfigError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
