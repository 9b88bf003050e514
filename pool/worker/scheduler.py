"""Scheduler: which requests compute which tokens in the next engine step (vLLM V1 policy).

Each step spends a budget of ``max_num_batched_tokens`` tokens:

1. Running requests, oldest first, get their next tokens: one for a decode, the rest of
   the prompt (up to the budget) for a chunked prefill. When a request's next block does
   not fit, the most recently admitted running request is preempted (its blocks freed,
   its tokens to be recomputed later; its cached prefix usually survives in the free
   queue) until it fits.
2. Waiting requests are admitted in arrival order while the budget and the free blocks
   allow, and no request was preempted in this step. With chunked prefill (vLLM V1's
   default) a prompt longer than the remaining budget starts with a chunk of it; without,
   it waits for a step with room for all of it (or runs alone when longer than the budget).

The scheduler owns the waiting and running queues and talks to the KVCacheManager; it
computes nothing and performs no I/O.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Generic, TypeVar

from pool.kv_cache_manager import KVCacheManager
from pool.request import Request

__all__ = ["Scheduled", "Scheduler"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Scheduled:
    """A request as the scheduler tracks it (extended by the engine with its own state).

    Attributes:
        request: The tokens, block hashes and ``num_computed_tokens``.
        num_cached_tokens: Prompt tokens found in the prefix cache at its first
            admission; -1 until then.
        num_scheduled_tokens: Tokens to compute in the current step.
    """

    request: Request
    num_cached_tokens: int = -1
    num_scheduled_tokens: int = 0


S = TypeVar("S", bound=Scheduled)


class Scheduler(Generic[S]):
    """Waiting and running queues over a KVCacheManager.

    Args:
        kv: Allocates and frees the requests' blocks.
        max_num_seqs: Requests running at once.
        max_num_batched_tokens: Tokens one step computes.
        chunked_prefill: Split prompts across steps to fit the budget; without, a
            prompt longer than the budget runs alone.

    Attributes:
        waiting: Requests to admit, oldest (or preempted) first.
        running: Admitted requests, oldest first; they hold blocks.
        num_preemptions: Preemptions so far.
        prefix_query_tokens: Tokens of admitted requests, counted at each admission.
        prefix_hit_tokens: Of those, tokens found in the prefix cache.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        chunked_prefill: bool = True,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        # NOTE: an entry is in at most one queue; exactly the running ones hold blocks.
        self.waiting: collections.deque[S] = collections.deque()
        self.running: list[S] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def has_work(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self.running or self.waiting)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: waiting requests' cache misses, running prefills'
        remaining chunks (the last token of each counts as decode work)."""
        waiting = sum(self._uncached_tokens(entry.request) for entry in self.waiting)
        running = sum(
            max(0, e.request.num_tokens - e.request.num_computed_tokens - 1) for e in self.running
        )
        return waiting + running

    def add(self, entry: S) -> None:
        """Queue a new request."""
        self.waiting.append(entry)

    def schedule(self) -> list[S]:
        """Pick the requests of the next step and allocate their slots.

        Returns:
            The scheduled entries, each with ``num_scheduled_tokens`` set; their
            ``request.num_computed_tokens`` counts the tokens already in the cache.
        """
        budget = self.max_num_batched_tokens
        scheduled: list[S] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            entry = self.running[index]
            request = entry.request
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is entry:
                    break
            else:
                entry.num_scheduled_tokens = num_new
                scheduled.append(entry)
                budget -= num_new
                index += 1
        while self.waiting and not preempted and len(self.running) < self.max_num_seqs:
            entry = self.waiting[0]
            request = entry.request
            hits, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if self.chunked_prefill:
                num_new = min(num_new, budget)
                if num_new <= 0:
                    break
            elif num_new > budget and scheduled:
                break
            if self.kv.allocate_slots(request, num_new, num_hit, hits) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if entry.num_cached_tokens < 0:
                entry.num_cached_tokens = num_hit
            # Counted once per admission: a request that waits is looked up every step.
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += num_hit
            entry.num_scheduled_tokens = num_new
            self.running.append(entry)
            scheduled.append(entry)
            budget -= num_new
        return scheduled

    def finish(self, entry: S) -> None:
        """Retire a running request and free its blocks."""
        self.running.remove(entry)
        self.kv.free(entry.request)

    def discard(self, entry: S) -> None:
        """Retire a running request whose computation failed (see ``KVCacheManager.discard``)."""
        self.running.remove(entry)
        self.kv.discard(entry.request)

    def remove(self, request_id: str) -> S | None:
        """Take a request out of either queue (freeing its blocks); ``None`` if unknown."""
        for entry in self.running:
            if entry.request.request_id == request_id:
                self.finish(entry)
                return entry
        for entry in self.waiting:
            if entry.request.request_id == request_id:
                self.waiting.remove(entry)
                return entry
        return None

    def _uncached_tokens(self, request: Request) -> int:
        # The longest hit of get_computed_blocks, read without touching the pool or stats.
        size = self.kv.block_size
        num_hit = 0
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // size]:
            if self.kv.block_pool.get_cached_block(block_hash) is None:
                break
            num_hit += size
        return request.num_tokens - num_hit

    def _preempt(self, entry: S) -> None:
        self.kv.free(entry.request)
        entry.request.num_computed_tokens = 0
        self.waiting.appendleft(entry)
        self.num_preemptions += 1
        logger.debug("preempted %s", entry.request.request_id)
