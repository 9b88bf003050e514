"""The engine loop: admits, schedules, computes and samples requests, and publishes KV events.

One synchronous thread owns the :class:`KVCacheManager`, the :class:`PagedKVCache` and the
model. Other threads talk to it only through :meth:`Engine.submit` and :meth:`Engine.call`,
which enqueue work for the loop, and receive results through the sinks they pass in.

Each step follows vLLM V1's scheduler:

1. Every running request gets one decode token. When its next block does not fit, the
   most recently admitted running request is preempted (its blocks freed, its tokens to be
   recomputed later; its cached prefix usually survives) until it fits.
2. Waiting requests are admitted in arrival order while their uncached tokens fit the
   token budget and the free blocks (no admission in a step that preempted).
3. One paged forward computes all scheduled tokens; one token is sampled per request.
4. Finished requests free their blocks; the step's KV events (evictions before the stores
   of the same allocation) go out as one batch, if there are any.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

import torch

from events.schema import KVEventBatch
from pool.errors import PoolError
from pool.kv_cache_manager import KVCacheManager
from pool.model import DecoderModel, ForwardItem
from pool.paged_cache import PagedKVCache
from pool.request import Request
from pool.snapshot import CachedChains, ChainRun

__all__ = [
    "BatchPublisher",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "InvalidRequestError",
    "OutputSink",
    "RequestOutput",
    "SamplingParams",
    "Snapshot",
]

logger = logging.getLogger(__name__)

_IDLE_WAIT_S: Final = 0.05
T = TypeVar("T")


class InvalidRequestError(PoolError, ValueError):
    """A request can never be served (empty, out of vocabulary, larger than the cache...)."""


class EngineClosedError(PoolError, RuntimeError):
    """The engine is draining or stopped and takes no new work."""


class BatchPublisher(Protocol):
    """Where the engine publishes its KV event batches (an ``EventPublisher``)."""

    def publish(self, batch: KVEventBatch) -> bool:
        """Send ``batch``; ``False`` when it had to be dropped."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    """How to generate the tokens of one request.

    Attributes:
        max_tokens: Tokens to generate at most (at least 1).
        temperature: 0 for greedy decoding, else the softmax temperature.
        ignore_eos: Keep generating after the end-of-sequence token.
        seed: Seed of this request's sampler; ``None`` uses the engine's generator.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        request_id: The request.
        new_token_ids: Tokens generated in this step (empty when only finishing).
        finish_reason: ``"stop"`` (end of sequence), ``"length"`` (``max_tokens``),
            ``"abort"``, or ``None`` while running.
        num_prompt_tokens: Prompt length.
        num_cached_tokens: Prompt tokens found in the prefix cache at first admission.
        num_output_tokens: Tokens generated so far.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int

    @property
    def finished(self) -> bool:
        """Whether this is the request's last output."""
        return self.finish_reason is not None


OutputSink = Callable[[RequestOutput], None]
"""Called on the engine thread with each output; must not block."""


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling limits of the engine.

    Attributes:
        max_num_seqs: Requests running at once.
        max_num_batched_tokens: Tokens one step computes (a longer prompt still runs,
            alone).
        data_parallel_rank: ``data_parallel_rank`` of the published batches.
        seed: Seed of the engine's sampler.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    data_parallel_rank: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A consistent view of the engine's load and counters, taken between steps.

    Attributes:
        num_running: Requests holding blocks and decoding.
        num_waiting: Requests queued (new or preempted).
        num_free_blocks: Blocks that can be allocated (cached ones included).
        num_usable_blocks: Blocks of the pool, the null block excluded.
        usage: Fraction of the usable blocks held by requests.
        prefix_query_tokens: Tokens of admitted requests, counted at each admission.
        prefix_hit_tokens: Of those, tokens found in the prefix cache.
        num_preemptions: Requests preempted so far.
        num_steps: Steps run so far.
        num_batches_published: Event batches the sink accepted.
        num_batches_dropped: Event batches the sink dropped.
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_usable_blocks: int
    usage: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int
    num_batches_published: int
    num_batches_dropped: int


@dataclass(frozen=True)
class Snapshot:
    """The cached chains at a step boundary.

    Attributes:
        next_seq: Number of batches the engine has handed to its sink: the snapshot
            reflects exactly the batches with seq below it.
        block_size: Tokens per block.
        runs: The cached blocks (see :class:`pool.snapshot.CachedChains`).
    """

    next_seq: int
    block_size: int
    runs: list[ChainRun]


@dataclass
class _Sequence:
    request: Request
    params: SamplingParams
    sink: OutputSink
    generator: torch.Generator | None
    num_cached_tokens: int = -1  # -1 until first admitted
    finish_reason: str | None = None
    scheduled_tokens: int = 0


class Engine:
    """The worker's engine loop.

    Args:
        model: The model.
        cache: Its paged KV cache; must have as many blocks as ``kv_cache_manager``.
        kv_cache_manager: Block allocation and prefix caching (events enabled to publish).
        config: Scheduling limits.
        event_sink: Where KV event batches go; ``None`` publishes nothing.
        eos_token_id: The end-of-sequence id, or ``None``.
        step_observer: Called on the engine thread with each step's duration in seconds.

    Attributes:
        step_observer: The step observer; may be set before :meth:`start`.
    """

    def __init__(
        self,
        model: DecoderModel,
        cache: PagedKVCache,
        kv_cache_manager: KVCacheManager,
        config: EngineConfig | None = None,
        *,
        event_sink: BatchPublisher | None = None,
        eos_token_id: int | None = None,
        step_observer: Callable[[float], None] | None = None,
    ) -> None:
        if cache.config.num_blocks != kv_cache_manager.config.num_blocks:
            raise ValueError(
                f"cache has {cache.config.num_blocks} blocks, the manager "
                f"{kv_cache_manager.config.num_blocks}; they must be equal"
            )
        self.model = model
        self.cache = cache
        self.kv = kv_cache_manager
        self.config = config or EngineConfig()
        self.eos_token_id = eos_token_id
        self._sink = event_sink
        self.step_observer = step_observer
        self._generator = torch.Generator(device=model.device).manual_seed(self.config.seed)
        self._chains = CachedChains(kv_cache_manager.block_size)
        # NOTE: touched only by the engine thread (or by step() callers when not started).
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._num_preemptions = 0
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._num_steps = 0
        self._num_batches = 0
        self._num_dropped = 0
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._accepting = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- thread-safe API

    @property
    def max_request_tokens(self) -> int:
        """Prompt plus generated tokens one request may reach: the usable blocks' tokens."""
        return (self.kv.config.num_blocks - 1) * self.kv.block_size

    @property
    def is_accepting(self) -> bool:
        """False once :meth:`drain` or :meth:`stop` was called, or the loop failed."""
        return self._accepting

    @property
    def is_running(self) -> bool:
        """Whether the loop thread is alive (outputs can still come)."""
        return self._thread is not None and self._thread.is_alive()

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Reject a request that could never be served.

        Raises:
            InvalidRequestError: With a message saying what to change.
        """
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: send at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"token ids must be in [0, {vocab}), got {bad[:5]}{'...' if len(bad) > 5 else ''}"
            )
        if params.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {params.max_tokens}")
        if params.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {params.temperature}")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_request_tokens:
            raise InvalidRequestError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"= {total} tokens exceeds what this worker's KV cache can ever hold "
                f"({self.max_request_tokens}); shorten the prompt or lower max_tokens"
            )

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        sink: OutputSink,
    ) -> None:
        """Queue a request; its outputs go to ``sink`` on the engine thread.

        Raises:
            InvalidRequestError: The request could never be served.
            EngineClosedError: The engine is draining or stopped.
        """
        self.validate(prompt_token_ids, params)
        if not self._accepting:
            raise EngineClosedError("the worker is shutting down and takes no new requests")
        request = self.kv.make_request(request_id, prompt_token_ids)
        generator = None
        if params.temperature > 0 and params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        seq = _Sequence(request, params, sink, generator)
        self._inbox.put(lambda: self._waiting.append(seq))

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its client went away); its sink gets ``"abort"``."""
        self._inbox.put(lambda: self._abort(request_id))

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread between two steps.

        Returns:
            A future with ``fn``'s result or exception.
        """
        future: Future[T] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

        self._inbox.put(run)
        return future

    def start(self) -> None:
        """Run the loop on a background thread."""
        self._thread = threading.Thread(target=self._run, name="kvroute-engine", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Take no new requests; the loop exits once every queued request has finished."""
        self._accepting = False
        self._inbox.put(lambda: None)  # wake the loop

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Drain, then wait for the loop thread to exit.

        Returns:
            True when the thread exited within ``timeout_s``.
        """
        self.drain()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ----------------------------------------------------- engine thread (or tests)

    @property
    def has_work(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self._running or self._waiting)

    def stats(self) -> EngineStats:
        """Load and counters; call on the engine thread (through :meth:`call`)."""
        pool = self.kv.block_pool
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_free_blocks=pool.get_num_free_blocks(),
            num_usable_blocks=pool.num_gpu_blocks - 1,
            usage=pool.get_usage(),
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            num_batches_published=self._num_batches - self._num_dropped,
            num_batches_dropped=self._num_dropped,
        )

    def snapshot(self) -> Snapshot:
        """The cached chains; call on the engine thread (through :meth:`call`)."""
        return Snapshot(self._num_batches, self.kv.block_size, self._chains.runs())

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (``AllBlocksCleared``), only when no request holds blocks.

        Call on the engine thread (through :meth:`call`). The event goes out at once.

        Returns:
            True on success, False while requests run.
        """
        done = self.kv.reset_prefix_cache()
        self._publish_events()
        return done

    def run_inbox(self, block: bool) -> None:
        """Run the queued calls; with ``block``, wait a short while for the first."""
        try:
            job = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        job()
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                return

    def step(self) -> None:
        """Schedule, compute and sample one step, then publish its events."""
        started = time.perf_counter()
        scheduled = self._schedule()
        if scheduled:
            self._execute(scheduled)
        self._publish_events()
        self._num_steps += 1
        if self.step_observer is not None:
            self.step_observer(time.perf_counter() - started)

    def _run(self) -> None:
        try:
            while True:
                self.run_inbox(block=not self.has_work)
                if self.has_work:
                    self.step()
                elif not self._accepting:
                    return
        except Exception:
            logger.exception("engine loop failed; the worker stops serving")
            self._accepting = False
            for seq in [*self._running, *self._waiting]:
                seq.sink(self._output(seq, [], "abort"))
            raise

    def _schedule(self) -> list[_Sequence]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[_Sequence] = []
        preempted = False
        index = 0
        while index < len(self._running):
            seq = self._running[index]
            while self.kv.allocate_slots(seq.request, 1) is None:
                victim = self._running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                seq.scheduled_tokens = 1
                scheduled.append(seq)
                budget -= 1
                index += 1
        while (
            self._waiting and not preempted and len(self._running) < self.config.max_num_seqs
        ):
            seq = self._waiting[0]
            request = seq.request
            hits, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget and scheduled:
                break
            if self.kv.allocate_slots(request, num_new, num_hit, hits) is None:
                break
            self._waiting.popleft()
            request.num_computed_tokens = num_hit
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit
            # Counted once per admission: a request that waits is looked up every step.
            self._prefix_query_tokens += request.num_tokens
            self._prefix_hit_tokens += num_hit
            seq.scheduled_tokens = num_new
            self._running.append(seq)
            scheduled.append(seq)
            budget -= num_new
        return scheduled

    def _preempt(self, seq: _Sequence) -> None:
        self.kv.free(seq.request)
        seq.request.num_computed_tokens = 0
        self._waiting.appendleft(seq)
        self._num_preemptions += 1
        logger.debug("preempted %s", seq.request.request_id)

    def _execute(self, scheduled: list[_Sequence]) -> None:
        items = []
        for seq in scheduled:
            request = seq.request
            start = request.num_computed_tokens
            items.append(
                ForwardItem(
                    request.all_token_ids[start : start + seq.scheduled_tokens],
                    start,
                    self.kv.get_block_ids(request.request_id),
                )
            )
        logits = self.model.forward_paged(items, self.cache)
        tokens = self._sample(logits, scheduled)
        for seq, token in zip(scheduled, tokens, strict=True):
            request = seq.request
            request.num_computed_tokens += seq.scheduled_tokens
            request.append_output_token_ids(token)
            reason = None
            if token == self.eos_token_id and not seq.params.ignore_eos:
                reason = "stop"
            elif len(request.output_token_ids) >= seq.params.max_tokens:
                reason = "length"
            if reason is not None:
                self._running.remove(seq)
                self.kv.free(request)
            seq.sink(self._output(seq, [token], reason))

    def _sample(self, logits: torch.Tensor, scheduled: list[_Sequence]) -> list[int]:
        tokens: list[int] = logits.argmax(-1).tolist()
        for row, seq in enumerate(scheduled):
            temperature = seq.params.temperature
            if temperature > 0:
                probs = torch.softmax(logits[row] / temperature, -1)
                generator = seq.generator or self._generator
                tokens[row] = int(torch.multinomial(probs, 1, generator=generator))
        return tokens

    def _abort(self, request_id: str) -> None:
        for seq in self._running:
            if seq.request.request_id == request_id:
                self._running.remove(seq)
                self.kv.free(seq.request)
                seq.sink(self._output(seq, [], "abort"))
                return
        for seq in self._waiting:
            if seq.request.request_id == request_id:
                self._waiting.remove(seq)
                seq.sink(self._output(seq, [], "abort"))
                return

    def _publish_events(self) -> None:
        events = self.kv.take_events()
        if not events:
            return
        self._chains.apply(events)
        if self._sink is None:
            return
        batch = KVEventBatch(time.time(), events, self.config.data_parallel_rank)  # type: ignore[arg-type]
        self._num_batches += 1
        if not self._sink.publish(batch):
            self._num_dropped += 1
            logger.warning("KV event batch dropped: the publisher queue is full")

    @staticmethod
    def _output(seq: _Sequence, tokens: list[int], reason: str | None) -> RequestOutput:
        request = seq.request
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_output_tokens=len(request.output_token_ids),
        )
