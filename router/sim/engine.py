"""The trace simulator's engine: routes a trace over simulated workers, in simulated time.

Each simulated worker is a KV cache (:class:`WorkerCache`, a real ``pool.KVCacheManager``
in ``kvroute sim``) with one prefill queue. Requests arrive at their trace timestamps
(divided by ``speed``) and are routed by the router's own code: router keys from
:class:`events.hashing.RouterKeyer`, a lookup in a
:class:`router.index.memory.MemoryPrefixIndex` fed with the workers' own KV events (through
a :class:`router.ingest.bridged_index.BridgedIndex`), predicted entries, a
:class:`router.load.model.MemoryLoadTracker`, and the router's one decision path
(:func:`router.routing.decider.decide`). Only the network is missing.

Latency model: a worker prefills one request at a time, in arrival order, taking
``uncached tokens / prefill_tokens_per_s``; the request's blocks are allocated when its
prefill starts (the cache hit is what the pool finds then) and its KV events reach the
index when the prefill ends (a worker announces blocks once computed). Decoding runs
alongside, batched, ``output tokens * decode_s_per_token`` after the prefill, and then
frees the blocks. TTFT is arrival to prefill end. Decode tokens are not cached.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from events.schema import KVCacheEvent, KVEventBatch
from router.cluster.workload import TRACE_BLOCK_TOKENS
from router.index.memory import MemoryPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.load.model import MemoryLoadTracker, finished, prefilled, routed
from router.routing.decider import DecisionInputs, decide
from router.routing.policies import Decision, PolicyConfig, RouteRequest, RoutingPolicy
from router.routing.predicted import PredictedEntries
from router.routing.share import WorkShares
from router.sim.trace import SimError, SimRequest

__all__ = [
    "DecisionHook",
    "RequestOutcome",
    "SimConfig",
    "WorkerCache",
    "WorkerCacheFactory",
    "simulate",
]


class WorkerCache(Protocol):
    """What the simulator needs from one worker's KV cache."""

    def admit(self, request_id: str, token_ids: Sequence[int]) -> int | None:
        """Look up a new request's cached prefix and allocate blocks for its whole prompt.

        Returns:
            Prompt tokens found in the cache, or ``None`` when the blocks do not fit now
            (then nothing changed; retry after a :meth:`release`).
        """
        ...

    def release(self, request_id: str) -> None:
        """Free a finished request's blocks (they stay cached until reused)."""
        ...

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call, in emission order."""
        ...


WorkerCacheFactory = Callable[[int, int], WorkerCache]
"""``factory(capacity_blocks, block_size)``: a fresh, empty worker cache."""

DecisionHook = Callable[[DecisionInputs, Decision], None]
"""``hook(inputs, decision)``: sees every routing decision of a simulation, in order."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Settings of one simulation.

    Attributes:
        num_workers: Simulated workers.
        capacity_blocks: KV cache blocks per worker.
        block_size: Tokens per KV cache block (the trace's blocks are 512 tokens).
        speed: Trace time is divided by this (2.0 replays twice as fast: twice the load).
        prefill_tokens_per_s: Prefill speed of a worker, in uncached tokens per second.
        decode_s_per_token: Time per generated token of one request (decode is batched, so
            requests decode side by side).
        policy: Settings of the routing policy.
        key_seed: Seed of the router keys.
    """

    num_workers: int = 8
    capacity_blocks: int = 5_859
    block_size: int = TRACE_BLOCK_TOKENS
    speed: float = 1.0
    prefill_tokens_per_s: float = 10_000.0
    decode_s_per_token: float = 0.02
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    key_seed: int = 0

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.capacity_blocks < 1 or self.block_size < 1:
            raise SimError(
                "workers, capacity blocks and block size must be >= 1, got "
                f"{self.num_workers}, {self.capacity_blocks}, {self.block_size}"
            )
        if not (self.speed > 0 and self.prefill_tokens_per_s > 0):
            raise SimError("speed and prefill_tokens_per_s must be > 0")
        if not self.decode_s_per_token >= 0:
            raise SimError("decode_s_per_token must be >= 0")


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What happened to one request.

    Attributes:
        index: The request's position in the trace.
        worker: Index of the worker it went to.
        hit_tokens: Prompt tokens its worker's cache held when its prefill started.
        predicted_tokens: Prompt tokens the router expected that worker to hold.
        prefill_tokens: Prompt tokens its worker computed.
        ttft_s: Arrival to end of prefill, in simulated seconds.
    """

    index: int
    worker: int
    hit_tokens: int
    predicted_tokens: int
    prefill_tokens: int
    ttft_s: float


@dataclass(slots=True)
class _Job:
    request: SimRequest
    tokens: list[int]
    worker: int
    arrival_s: float
    expected_prefill: int
    predicted_tokens: int
    hit_tokens: int = 0
    events: list[KVCacheEvent] = field(default_factory=list)


@dataclass(slots=True)
class _Worker:
    worker_id: WorkerId
    cache: WorkerCache
    queue: deque[_Job] = field(default_factory=deque)
    is_prefilling: bool = False


# Simultaneous happenings resolve in this order: finished prefills publish their blocks
# before finished decodes free memory, and both before new arrivals are routed.
_PREFILLED: Final = 0
_DECODED: Final = 1
_ARRIVAL: Final = 2


class _Simulation:
    def __init__(
        self,
        policy: RoutingPolicy,
        config: SimConfig,
        factory: WorkerCacheFactory,
        on_decision: DecisionHook | None = None,
    ) -> None:
        self.policy = policy
        self.on_decision = on_decision
        self.config = config
        self.keyer = RouterKeyer(config.key_seed)
        self.index = BridgedIndex(MemoryPrefixIndex(), self.keyer)
        self.loads = MemoryLoadTracker()
        self.predicted = PredictedEntries(policy.credit_ttl_s) if policy.credit_ttl_s > 0 else None
        self.shares = WorkShares(config.policy.weights.fair_share_half_life_s)
        self.workers = [
            _Worker(WorkerId(f"sim-{i}"), factory(config.capacity_blocks, config.block_size))
            for i in range(config.num_workers)
        ]
        self.worker_ids = [w.worker_id for w in self.workers]
        self.heap: list[tuple[float, int, int, _Job | SimRequest]] = []
        self.order = itertools.count()
        self.outcomes: list[RequestOutcome] = []

    def push(self, at_s: float, kind: int, item: _Job | SimRequest) -> None:
        heapq.heappush(self.heap, (at_s, kind, next(self.order), item))

    async def route(self, request: SimRequest, now_s: float) -> None:
        tokens = request.token_ids()
        keys: list[BlockKey] = self.keyer.keys(tokens, self.config.block_size)
        workers = self.worker_ids
        matches = await self.index.lookup(keys, workers) if self.policy.uses_index else {}
        predicted = self.predicted.lookup(keys, workers, now_s) if self.predicted else {}
        loads = await self.loads.snapshot(workers)
        route_request = RouteRequest(
            keys, request.num_prompt_tokens, self.config.block_size, request.num_output_tokens
        )
        recent = self.shares.snapshot(workers, now_s)
        inputs = DecisionInputs(route_request, workers, loads, matches, predicted, recent)
        decision = decide(self.policy, inputs)
        if self.on_decision is not None:
            self.on_decision(inputs, decision)
        if self.predicted is not None:
            self.predicted.credit(decision.worker_id, keys, now_s)
        self.shares.add(decision.worker_id, decision.prefill_tokens, now_s)
        await self.loads.add(
            decision.worker_id, routed(decision.prefill_tokens, request.num_output_tokens)
        )
        worker = self.worker_ids.index(decision.worker_id)
        job = _Job(
            request,
            tokens,
            worker,
            now_s,
            decision.prefill_tokens,
            decision.chosen.predicted_tokens,
        )
        self.workers[worker].queue.append(job)
        self.start_next(worker, now_s)

    def start_next(self, worker_index: int, now_s: float) -> None:
        worker = self.workers[worker_index]
        if worker.is_prefilling or not worker.queue:
            return
        job = worker.queue[0]
        hit = worker.cache.admit(str(job.request.index), job.tokens)
        if hit is None:
            return  # waits for a running request to free its blocks
        worker.queue.popleft()
        worker.is_prefilling = True
        job.hit_tokens = hit
        job.events = worker.cache.take_events()
        compute = job.request.num_prompt_tokens - hit
        self.push(now_s + compute / self.config.prefill_tokens_per_s, _PREFILLED, job)

    async def prefilled(self, job: _Job, now_s: float) -> None:
        worker = self.workers[job.worker]
        worker.is_prefilling = False
        if job.events:
            # The pool's events are the concrete event types the batch holds.
            batch = KVEventBatch(ts=now_s, events=job.events)  # type: ignore[arg-type]
            await self.index.apply(worker.worker_id, batch)
            job.events = []
        await self.loads.add(worker.worker_id, prefilled(job.expected_prefill))
        request = job.request
        self.outcomes.append(
            RequestOutcome(
                request.index,
                job.worker,
                job.hit_tokens,
                job.predicted_tokens,
                request.num_prompt_tokens - job.hit_tokens,
                now_s - job.arrival_s,
            )
        )
        decode_s = request.num_output_tokens * self.config.decode_s_per_token
        self.push(now_s + decode_s, _DECODED, job)
        job.tokens = []
        self.start_next(job.worker, now_s)

    async def decoded(self, job: _Job, now_s: float) -> None:
        worker = self.workers[job.worker]
        worker.cache.release(str(job.request.index))
        await self.loads.add(worker.worker_id, finished(job.request.num_output_tokens))
        self.start_next(job.worker, now_s)


async def simulate(
    requests: Sequence[SimRequest],
    policy: RoutingPolicy,
    config: SimConfig,
    factory: WorkerCacheFactory,
    on_arrival: Callable[[], None] | None = None,
    on_decision: DecisionHook | None = None,
) -> list[RequestOutcome]:
    """Replay ``requests`` through ``policy`` over fresh workers.

    Args:
        requests: The trace, in arrival order.
        policy: A fresh routing policy (its state is part of the run).
        config: Workers, capacity, latency model.
        factory: Makes each worker's cache.
        on_arrival: Called once per request routed (progress reporting).
        on_decision: Called with each decision and the inputs it was made on, in order
            (to study or re-check the routing).

    Returns:
        One outcome per request, in trace order.

    Raises:
        SimError: A request needs more blocks than a worker has.
    """
    bs = config.block_size
    for r in requests:
        if -(-r.num_prompt_tokens // bs) > config.capacity_blocks:
            raise SimError(
                f"request {r.index} needs {-(-r.num_prompt_tokens // bs)} blocks of {bs} "
                f"tokens but a worker has {config.capacity_blocks}; raise --capacity-blocks"
            )
    sim = _Simulation(policy, config, factory, on_decision)
    for r in requests:
        sim.push(r.arrival_s / config.speed, _ARRIVAL, r)
    while sim.heap:
        now_s, kind, _, item = heapq.heappop(sim.heap)
        if kind == _ARRIVAL:
            assert isinstance(item, SimRequest)
            await sim.route(item, now_s)
            if on_arrival is not None:
                on_arrival()
        elif kind == _PREFILLED:
            assert isinstance(item, _Job)
            await sim.prefilled(item, now_s)
        else:
            assert isinstance(item, _Job)
            await sim.decoded(item, now_s)
    outcomes = sorted(sim.outcomes, key=lambda o: o.index)
    assert len(outcomes) == len(requests), "every request is prefilled exactly once"
    return outcomes
