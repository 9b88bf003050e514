"""Routing decisions: a request's candidates keyed, their matches and load gathered, a policy asked.

:class:`RouteDecider` reads the prefix index through :mod:`router.front.lookup` (load
alone when the lookup fails or Redis refuses the ingest's writes: the index never causes
a 5xx), credits the chosen worker with the prefix it is about to compute
(:mod:`router.routing.predicted`) and its work share (:mod:`router.routing.share`), and
counts and logs the decision.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from router.front.candidates import RoutableWorkers
from router.front.decision_log import DecisionLog
from router.front.lookup import IndexLookup
from router.front.metrics import RouterMetrics
from router.front.proxy_contracts import ProxyTarget
from router.front.request_context import RequestContext
from router.front.targets import RankedTargets
from router.index.base import PrefixMatch
from router.ingest.service import IndexIngest
from router.load.shared import RedisLoadTracker
from router.routing.decider import DecisionInputs, decide
from router.routing.policies import CandidateScore, Decision, RouteRequest, RoutingPolicy
from router.routing.predicted import PredictedEntries
from router.routing.request_keys import RequestKeys, key_request
from router.routing.sessions import SessionTable
from router.routing.share import WorkShares

__all__ = ["RouteDecider", "Routed"]


@dataclass(frozen=True, slots=True)
class Routed:
    """A routing decision with what is needed to act on it.

    Attributes:
        decision: The policy's decision and explanation.
        targets: Candidates to forward to, best first (the chosen one first).
        keys: The request's router keys per candidate block size (the worker that
            serves it is credited with those of its size).
        num_prompt_tokens: Prompt length.
        num_output_tokens: Expected output tokens.
        chosen: ``decision.chosen``, found once.
    """

    decision: Decision
    targets: Sequence[ProxyTarget]
    keys: RequestKeys
    num_prompt_tokens: int
    num_output_tokens: int
    chosen: CandidateScore

    def prefill_of(self, worker_id: WorkerId) -> int:
        """Prompt tokens ``worker_id`` is expected to compute for this request."""
        chosen = self.chosen
        if worker_id == chosen.worker_id:  # nearly always: no scan of every candidate
            return max(self.num_prompt_tokens - chosen.predicted_tokens, 0)
        for c in self.decision.candidates:
            if c.worker_id == worker_id:
                return max(self.num_prompt_tokens - c.predicted_tokens, 0)
        return self.num_prompt_tokens


class RouteDecider:
    """Decides where requests go, from a replica's routing state.

    Args:
        policy: The routing policy.
        keyer: Keys prompts as the index does.
        metrics: Where decisions are counted.
        candidates: The workers a request may go to.
        lookup: The index reads.
        ingest: The replica's ingest (whether Redis takes its index writes).
        load: The shared in-flight load.
        predicted: The predicted entries (``None``: crediting is off).
        shares: Recent work per worker (fair share).
        sessions: Session key -> worker (``None``: affinity off).
        decision_log: Where each decision is logged (``None``: nowhere).
        credit: Credits a worker with a prefix it is about to compute.
    """

    def __init__(
        self,
        policy: RoutingPolicy,
        keyer: RouterKeyer,
        metrics: RouterMetrics,
        candidates: RoutableWorkers,
        lookup: IndexLookup,
        ingest: IndexIngest,
        load: RedisLoadTracker,
        *,
        predicted: PredictedEntries | None,
        shares: WorkShares,
        sessions: SessionTable | None,
        decision_log: DecisionLog | None,
        credit: Callable[[WorkerId, Sequence[BlockKey]], None],
    ) -> None:
        self.policy = policy
        self.keyer = keyer
        self.metrics = metrics
        self._candidates = candidates
        self._lookup = lookup
        self._ingest = ingest
        self.load = load
        self._predicted = predicted
        self._shares = shares
        self.sessions = sessions
        self._decision_log = decision_log
        self._credit = credit

    async def decide(
        self,
        token_ids: Sequence[int],
        num_output_tokens: int,
        *,
        cache_salt: str | None = None,
        record: bool = True,
        model: str | None = None,
        context: RequestContext | None = None,
        session: str | None = None,
    ) -> Routed:
        """Choose a worker for a prompt.

        Args:
            token_ids: The prompt's token ids (empty: route on load alone).
            num_output_tokens: Expected output tokens (``max_tokens``).
            cache_salt: The request's cache salt, if any.
            record: Credit predicted entries, count metrics and log the decision (False
                for a dry run, which changes nothing).
            model: The request's ``model``: only workers serving it are candidates.
            context: The request's id and trace (for the decision log).
            session: The request's session key: the worker that served the session last
                gets the session bonus (:mod:`router.routing.sessions`).

        Returns:
            The decision and the forwarding order.

        Raises:
            NoWorkersError: No worker is registered, or every one's circuit is open.
            router.workers.models.ModelNotFoundError: No worker serves ``model``.
            router.workers.models.ModelRequiredError: ``model`` is ``None`` and several
                models are served.
        """
        started = time.perf_counter()
        candidates = self._candidates.for_request(model)
        # Keyed once per block size among the candidates, prefixes counted in blocks of
        # the smallest (see router.routing.request_keys): a worker registered with another block
        # size never changes what the others match.
        keyed = key_request(self.keyer, token_ids, candidates.groups, cache_salt)
        workers = candidates.worker_ids
        matches: Mapping[WorkerId, PrefixMatch] = {}
        if self.policy.uses_index and self._ingest.index_writable:
            matches = await self._lookup.matches(keyed)
        now = time.monotonic()
        # Only the workers that differ from an idle one holding nothing are gathered (and
        # scored: router.routing.decider), whatever the number of candidates.
        positions = candidates.positions
        predicted = self._predicted_blocks(keyed, positions, now) or {}
        loads = self.load.busy(positions)
        recent = self._shares.recorded(positions, now)
        sessions = self.sessions
        served_last = (
            sessions.worker_of(session, now)
            if session is not None and sessions is not None
            else None
        )
        request = RouteRequest(keyed.base_keys, len(token_ids), keyed.base, num_output_tokens)
        inputs = DecisionInputs(
            request,
            workers,
            loads,
            matches,
            predicted,
            recent,
            session_worker=served_last,
            session_bonus_tokens=sessions.config.bonus_tokens if sessions is not None else 0,
            positions=positions,
        )
        decision = decide(self.policy, inputs)
        targets = RankedTargets(decision, candidates.by_id)
        chosen = decision.chosen
        routed_ = Routed(decision, targets, keyed, len(token_ids), num_output_tokens, chosen)
        if record:
            self._credit(decision.worker_id, keyed.of(decision.worker_id))
            self._shares.add(decision.worker_id, decision.prefill_tokens, now)
            self._record(decision, chosen, len(token_ids), context)
        self.metrics.decision_seconds.labels(decision.policy).observe(time.perf_counter() - started)
        return routed_

    def _predicted_blocks(
        self, keyed: RequestKeys, candidates: Collection[WorkerId], now: float
    ) -> dict[WorkerId, int] | None:
        """Predicted prefix lengths per candidate, in blocks of ``keyed.base`` tokens."""
        if self._predicted is None:
            return None
        out: dict[WorkerId, int] = {}
        groups = keyed.groups
        for size, members in groups.items():
            among = candidates if len(groups) == 1 else set(members)
            found = self._predicted.lookup(keyed.keys[size], among, now)
            if size != keyed.base:
                found = {w: n * size // keyed.base for w, n in found.items()}
            out.update(found)
        return out

    def _record(
        self,
        decision: Decision,
        chosen: CandidateScore,
        num_prompt_tokens: int,
        context: RequestContext | None,
    ) -> None:
        self.metrics.decisions.labels(decision.worker_id, decision.policy).inc()
        self.metrics.matched_tokens.labels(decision.worker_id).inc(chosen.matched_tokens)
        self.metrics.predicted_tokens.labels(decision.worker_id).inc(chosen.predicted_tokens)
        if self._decision_log is not None:
            self._decision_log.write(
                decision,
                num_prompt_tokens,
                index_live=self._lookup.live and self._ingest.index_writable,
                request_id=context.request_id if context is not None else None,
                trace_id=context.trace_id if context is not None else None,
            )
