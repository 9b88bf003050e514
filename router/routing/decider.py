"""The routing decision in one place: what a shell gathered in, a Decision with its costs out.

Three shells decide routes, each gathering the same inputs its own way: the router service
(a Redis index lookup, predicted entries, the shared load), the simulator (an in-memory
index fed by simulated pools, simulated loads) and ``kvroute explain`` (an index replayed
from an event log, the loads and credits of the router's decision log). Each then calls
:func:`decide` and nothing else: it joins the inputs into candidates and runs the policy,
whose :class:`router.routing.policies.Decision` carries every candidate's score and, for
the cost-based policies, every term of its cost (:class:`router.routing.cost.CostBreakdown`)
with the weights applied. A shell shows or acts on those figures; it never recomputes
them, so the live router, the simulator and explain cannot disagree on the same inputs.

Pure: no I/O, no clock; the policy's own state (rotation, seeded sampling) is the only
thing a call changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from events.identity import WorkerId
from router.index.base import PrefixMatch
from router.load.model import WorkerLoad
from router.routing.cost import RecentWork
from router.routing.policies import (
    Candidate,
    CostPolicy,
    Decision,
    RouteRequest,
    RoutingPolicy,
    build_candidates,
)
from router.routing.sessions import with_session_bonus

__all__ = ["DecisionInputs", "decide"]


@dataclass(frozen=True, slots=True)
class DecisionInputs:
    """Everything a routing decision depends on, as a shell gathered it.

    Attributes:
        request: The request: its keys, prompt and output lengths.
        workers: The candidate workers, in a stable order (the decision lists them so).
        loads: Their loads (absent worker: idle).
        matches: The index lookup (absent worker: no match); empty when the policy does
            not read the index (``RoutingPolicy.uses_index``).
        predicted: Prefix lengths in blocks credited by predicted entries or route
            history (absent worker: none).
        recent: Their recent work (:class:`router.routing.share.WorkShares`), for the
            fair-share term (absent worker: none; empty: no such term).
        session_worker: The worker that served the request's session last, if any
            (:mod:`router.routing.sessions`).
        session_bonus_tokens: Its session-affinity credit in prompt tokens (0: none).
        positions: Each worker's index in ``workers``, when the shell keeps it (else it
            is built per decision).
    """

    request: RouteRequest
    workers: Sequence[WorkerId]
    loads: Mapping[WorkerId, WorkerLoad]
    matches: Mapping[WorkerId, PrefixMatch] = field(default_factory=dict)
    predicted: Mapping[WorkerId, int] = field(default_factory=dict)
    recent: Mapping[WorkerId, RecentWork] = field(default_factory=dict)
    session_worker: WorkerId | None = None
    session_bonus_tokens: int = 0
    positions: Mapping[WorkerId, int] | None = None


def decide(policy: RoutingPolicy, inputs: DecisionInputs) -> Decision:
    """The decision of ``policy`` on ``inputs``: the one routing path of every shell.

    Args:
        policy: The routing policy (its rotation or generator advances by one decision).
        inputs: What the shell gathered; ``inputs.workers`` must not be empty.

    Returns:
        The chosen worker, every candidate's score in the order of ``inputs.workers``,
        the chosen worker's expected prefill and, for cost-based policies, each
        candidate's cost terms and the weights they were scored with.
    """
    assert inputs.workers, "a decision needs at least one candidate"
    if isinstance(policy, CostPolicy) and not policy.samples:
        return policy.decide_sparse(inputs.request, inputs.workers, _special(inputs))
    candidates = build_candidates(
        inputs.workers, inputs.loads, inputs.matches, inputs.predicted, inputs.recent
    )
    if inputs.session_worker is not None:
        candidates = with_session_bonus(
            candidates, inputs.session_worker, inputs.session_bonus_tokens
        )
    return policy.decide(inputs.request, candidates)


_IDLE: Final = WorkerLoad()
_NO_WORK: Final = RecentWork()


def _special(inputs: DecisionInputs) -> list[tuple[int, Candidate]]:
    """The candidates that differ from an idle worker holding nothing, with their
    positions in ``inputs.workers``, by position.

    Costs O(the entries of the inputs' mappings): a worker absent from all of them is
    never looked at (bench_router's 1,000-worker row).
    """
    positions = inputs.positions
    if positions is None:
        positions = dict(zip(inputs.workers, range(len(inputs.workers)), strict=True))
    ids = {w for w, m in inputs.matches.items() if m.num_blocks}
    ids.update(w for w, n in inputs.predicted.items() if n)
    ids.update(w for w, load in inputs.loads.items() if load != _IDLE)
    ids.update(w for w, work in inputs.recent.items() if work != _NO_WORK)
    if inputs.session_worker is not None and inputs.session_bonus_tokens > 0:
        ids.add(inputs.session_worker)
    found = sorted((positions[w], w) for w in ids if w in positions)
    candidates = build_candidates(
        [w for _, w in found], inputs.loads, inputs.matches, inputs.predicted, inputs.recent
    )
    if inputs.session_worker is not None:
        candidates = with_session_bonus(
            candidates, inputs.session_worker, inputs.session_bonus_tokens
        )
    return [(pos, c) for (pos, _), c in zip(found, candidates, strict=True)]
