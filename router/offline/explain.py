"""Explain one routing decision: score a request against an index replayed to a moment.

Given the index as it stood (see :mod:`router.offline.replay`), a prompt and the candidate
workers, :func:`explain_request` computes the router keys, looks them up, and makes the
decision through the router's own decision path (:func:`router.routing.decider.decide`),
so every figure shown (each candidate's score and cost terms) is the one the router
computes on those inputs, never a second computation. With the router's decision record
for that request, the candidates' loads, predicted prefixes and recent work are taken from
it (the log of KV events does not hold them), and the replayed matches and pick are
compared with what the router saw and did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from events.hashing import RouterKeyer
from events.identity import WorkerId
from router.index.base import PrefixIndex
from router.load.model import WorkerLoad
from router.offline.replay import ReplayError
from router.routing.cost import CostBreakdown, CostWeights, RecentWork
from router.routing.decider import DecisionInputs, decide
from router.routing.policies import Decision, PolicyConfig, RouteRequest, make_policy

__all__ = [
    "Explanation",
    "RecordedCandidate",
    "RecordedDecision",
    "explain_request",
    "find_decision",
    "read_decisions",
]


@dataclass(frozen=True, slots=True)
class RecordedCandidate:
    """One candidate as the router's decision record shows it.

    Attributes:
        worker_id: The candidate.
        matched_tokens: Prompt tokens its confirmed prefix covered.
        predicted_tokens: Prompt tokens covered counting predicted entries.
        load: Its load at decision time.
        score: The score the policy gave it.
    """

    worker_id: WorkerId
    matched_tokens: int
    predicted_tokens: int
    load: WorkerLoad
    score: float


@dataclass(frozen=True, slots=True)
class RecordedDecision:
    """What the router did for one request (one record of its decision log).

    Attributes:
        ts: When it decided (seconds since the epoch).
        worker_id: The worker it chose.
        policy: The policy it used.
        num_prompt_tokens: The request's prompt length.
        candidates: Every candidate as it scored them.
        index_live: False when the router's index was unreachable and it routed on load
            alone (matched tokens are then all 0).
        costs: For cost-based policies, each candidate's cost terms, in the order of
            ``candidates`` (empty in logs of routers that did not record them).
        weights: The cost weights the router scored with (``None``: not recorded).
    """

    ts: float
    worker_id: WorkerId
    policy: str
    num_prompt_tokens: int
    candidates: tuple[RecordedCandidate, ...] = ()
    index_live: bool = True
    costs: tuple[CostBreakdown, ...] = ()
    weights: CostWeights | None = None


@dataclass(frozen=True)
class Explanation:
    """A decision re-made on the replayed index, and why it came out that way.

    Attributes:
        at_ts: The moment of the replayed index.
        num_prompt_tokens: The request's prompt length.
        block_size: Tokens per block of its keys.
        decision: The decision on the replayed state, with each candidate's cost terms.
        reason: Why the policy picked that worker, in one paragraph.
        recorded: The router's own decision, when a decision log was given.
    """

    at_ts: float
    num_prompt_tokens: int
    block_size: int
    decision: Decision
    reason: str = ""
    recorded: RecordedDecision | None = None

    @property
    def costs(self) -> Mapping[WorkerId, CostBreakdown]:
        """Each candidate's cost terms, for cost-based policies (else empty)."""
        return self.decision.costs_by_worker()

    @property
    def disagreements(self) -> list[str]:
        """Where the replayed state differs from what the router saw (empty: none)."""
        recorded = self.recorded
        if recorded is None:
            return []
        out: list[str] = []
        if recorded.worker_id != self.decision.worker_id:
            out.append(
                f"the router chose {recorded.worker_id}, the replayed state picks "
                f"{self.decision.worker_id}"
            )
        replayed = {c.worker_id: c.matched_tokens for c in self.decision.candidates}
        for c in recorded.candidates:
            mine = replayed.get(WorkerId(c.worker_id))
            if mine is None:
                out.append(f"{c.worker_id} was a candidate of the router, not of the replay")
            elif mine != c.matched_tokens:
                out.append(
                    f"{c.worker_id}: the router matched {c.matched_tokens} tokens, the replayed "
                    f"index {mine}"
                )
        return out

    @property
    def agrees(self) -> bool | None:
        """Whether the replay reproduces the router's view and pick; None without a record."""
        return None if self.recorded is None else not self.disagreements


def _reason(decision: Decision, num_prompt_tokens: int, *, reads_index: bool) -> str:
    chosen = decision.chosen
    costs = decision.costs_by_worker()
    if not costs or not reads_index:
        return (
            f"{decision.policy} does not read the prefix index; on the replayed inputs it "
            f"picks {chosen.worker_id} (score {chosen.score:g}). Its own state (rotation, "
            "sampling, route history) is not in the event log, so only the router's decision "
            "log says which worker it really picked."
        )
    mine = costs[chosen.worker_id]
    text = (
        f"{decision.policy} picks {chosen.worker_id}: the lowest cost, {mine.score:,.0f} "
        f"tokens of work. It caches {mine.cached_tokens:,.0f} of the {num_prompt_tokens:,} "
        f"prompt tokens, so it would compute {mine.prefill_tokens:,.0f}; it has "
        f"{mine.queued_prefill_tokens:,} prefill tokens queued, {mine.decode_tokens:,} decode "
        f"tokens and {mine.num_requests} requests in flight."
    )
    others = sorted(
        (c for c in decision.candidates if c.worker_id != chosen.worker_id),
        key=lambda c: c.score,
    )
    if not others:
        return text + " It is the only candidate."
    runner = costs[others[0].worker_id]
    text += (
        f" Next best: {others[0].worker_id} at {runner.score:,.0f} (caches "
        f"{runner.cached_tokens:,.0f}, {runner.queued_prefill_tokens:,} queued, "
        f"{runner.num_requests} in flight)."
    )
    if runner.score == mine.score:
        text += " The scores tie; the router breaks ties by rotation."
    shared = [(c.worker_id, costs[c.worker_id]) for c in decision.candidates]
    shared = [(w, cost) for w, cost in shared if cost.replicated_tokens > 0]
    if shared and decision.weights is not None:
        w = decision.weights
        names = ", ".join(f"{worker} {cost.replicated_tokens:,.0f}" for worker, cost in shared)
        text += (
            f" A prefix at least {w.replicated_holders} other workers cache costs "
            f"{w.replicated_prefill:g} per token to compute instead of {w.prefill:g} "
            f"(replicated tokens: {names})."
        )
    return text


async def explain_request(
    index: PrefixIndex,
    token_ids: Sequence[int],
    workers: Sequence[WorkerId],
    *,
    at_ts: float,
    policy: str = "cache_aware",
    config: PolicyConfig | None = None,
    block_size: int = 16,
    keyer: RouterKeyer | None = None,
    num_output_tokens: int = 0,
    recorded: RecordedDecision | None = None,
) -> Explanation:
    """Re-make the routing decision for one prompt on a replayed index.

    Args:
        index: The index as it stood at ``at_ts``.
        token_ids: The prompt.
        workers: The candidates (all workers the router knew).
        at_ts: The moment the index was replayed to.
        policy: The routing policy (one of ``router.routing.policies.POLICY_NAMES``).
        config: The policy settings the router ran with.
        block_size: Tokens per block.
        keyer: The router key function (its seed); default seed 0.
        num_output_tokens: Expected output tokens (decode load).
        recorded: The router's decision for this request: its candidates' loads and
            predicted prefixes are used, and its matches and pick compared.

    Returns:
        The explanation.

    Raises:
        CostConfigError: ``policy`` is unknown.
    """
    config = config or PolicyConfig()
    keyer = keyer or RouterKeyer()
    chooser = make_policy(policy, config)
    keys = keyer.keys(token_ids, block_size)
    matches = await index.lookup(keys, list(workers)) if chooser.uses_index and keys else {}
    loads: dict[WorkerId, WorkerLoad] = {}
    predicted: dict[WorkerId, int] = {}
    recent: dict[WorkerId, RecentWork] = {}
    session_worker: WorkerId | None = None
    session_bonus_tokens = 0
    if recorded is not None:
        costs = recorded.costs if len(recorded.costs) == len(recorded.candidates) else None
        for i, seen in enumerate(recorded.candidates):
            worker = WorkerId(seen.worker_id)
            loads[worker] = seen.load
            if costs is not None:  # the credit and recent work, as the router scored them
                credited = costs[i].credited_tokens // block_size
                recent[worker] = RecentWork(
                    costs[i].recent_requests, costs[i].recent_prefill_tokens
                )
                if costs[i].session_tokens:  # the session's worker, as the router credited it
                    session_worker, session_bonus_tokens = worker, costs[i].session_tokens
            else:  # older logs: a credit shows only where it exceeds the match
                credited = (
                    seen.predicted_tokens // block_size
                    if seen.predicted_tokens > seen.matched_tokens
                    else 0
                )
            if credited:
                predicted[worker] = credited
    request = RouteRequest(keys, len(token_ids), block_size, num_output_tokens)
    inputs = DecisionInputs(
        request,
        workers,
        loads,
        matches,
        predicted,
        recent,
        session_worker=session_worker,
        session_bonus_tokens=session_bonus_tokens,
    )
    decision = decide(chooser, inputs)
    return Explanation(
        at_ts=at_ts,
        num_prompt_tokens=len(token_ids),
        block_size=block_size,
        decision=decision,
        reason=_reason(decision, len(token_ids), reads_index=chooser.uses_index),
        recorded=recorded,
    )


def read_decisions(path: str | Path) -> list[RecordedDecision]:
    """Read a router decision log (JSON lines, one routing decision each).

    Raises:
        ReplayError: A line is not a decision record.
        OSError: The file cannot be read.
    """
    decoder = msgspec.json.Decoder(RecordedDecision)
    out: list[RecordedDecision] = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise ReplayError(f"{path}:{lineno}: not a decision record ({exc})") from exc
    return out


def find_decision(
    decisions: Iterable[RecordedDecision], at_ts: float, num_prompt_tokens: int
) -> RecordedDecision | None:
    """The router's last decision at or before ``at_ts`` for a prompt of that length."""
    matching = [d for d in decisions if d.ts <= at_ts and d.num_prompt_tokens == num_prompt_tokens]
    return max(matching, key=lambda d: d.ts, default=None)
