"""The engine loop: admits, schedules, computes and samples requests, and publishes KV events.

One synchronous thread owns the :class:`KVCacheManager`, the :class:`PagedKVCache` and the
model. Other threads talk to it only through :meth:`Engine.submit` and :meth:`Engine.call`,
which enqueue work for the loop, and receive results through the sinks they pass in.

Each step asks the :class:`~pool.worker.scheduler.Scheduler` which requests run (admission,
queueing and preemption as vLLM V1 does), computes all their tokens in one paged forward,
samples one token per request, retires the finished ones, and publishes the step's KV
events (evictions before the stores of the same allocation) as one batch, if any.
"""

from __future__ import annotations

import collections
import dataclasses
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
from pool.errors import InvalidRequestError, PoolError
from pool.kv_cache_manager import KVCacheManager
from pool.snapshot import CachedChains
from pool.worker.model import DecoderModel, ForwardItem
from pool.worker.outputs import (
    EngineStats,
    OutputSink,
    RequestFailure,
    RequestOutput,
    Snapshot,
    TokenLogprobs,
)
from pool.worker.paged_cache import PagedKVCache
from pool.worker.sampling import Sampler, SamplingError, SamplingParams, token_logprobs
from pool.worker.scheduler import Scheduled, Scheduler

__all__ = [
    "BatchPublisher",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "InvalidRequestError",
    "SamplingParams",
]
# InvalidRequestError and SamplingParams live in pool.errors and pool.worker.sampling; they are
# named here too because callers of the engine's API meet them with it.

logger = logging.getLogger(__name__)

_IDLE_WAIT_S: Final = 0.05
T = TypeVar("T")


class EngineClosedError(PoolError, RuntimeError):
    """The engine is draining or stopped and takes no new work."""


class BatchPublisher(Protocol):
    """Where the engine publishes its KV event batches (an ``EventPublisher``)."""

    def publish(self, batch: KVEventBatch) -> bool:
        """Send ``batch``; ``False`` when it had to be dropped."""
        ...


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling limits of the engine.

    Attributes:
        max_num_seqs: Requests running at once.
        max_num_batched_tokens: Tokens one step computes.
        enable_chunked_prefill: Split long prompts across steps (vLLM V1's default);
            off, a prompt longer than ``max_num_batched_tokens`` runs alone.
        data_parallel_rank: ``data_parallel_rank`` of the published batches.
        seed: Seed of the engine's sampler.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    data_parallel_rank: int | None = None
    seed: int = 0


@dataclass(eq=False, kw_only=True)
class _Sequence(Scheduled):
    params: SamplingParams
    sink: OutputSink
    generator: torch.Generator | None


@dataclass(frozen=True)
class _Job:
    """Work for the engine thread, and what to do instead once the engine has stopped."""

    run: Callable[[], None]
    cancel: Callable[[], None] = lambda: None


class Engine:
    """The worker's engine loop.

    A failure while computing or sampling one request fails that request only: it gets a
    last output with ``finish_reason == "error"`` and a :class:`RequestFailure`, its
    blocks are released (:meth:`KVCacheManager.discard`), and the step goes on for the
    others. When a batched forward pass raises, each request of the batch is computed
    alone to find which one failed. Anything else that raises on the engine thread ends
    the loop: every request then gets ``"abort"`` and :attr:`failure` says why.

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
        generator = torch.Generator(device=model.device).manual_seed(self.config.seed)
        self._sampler = Sampler(generator)
        self._chains = CachedChains(kv_cache_manager.block_size)
        # NOTE: touched only by the engine thread (or by step() callers when not started).
        self._scheduler: Scheduler[_Sequence] = Scheduler(
            kv_cache_manager,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            chunked_prefill=self.config.enable_chunked_prefill,
        )
        self._num_steps = 0
        self._num_batches = 0
        self._num_dropped = 0
        self._failures: collections.Counter[str] = collections.Counter()
        self._inbox: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        # NOTE: once _closed is set (under _lock) no job enters the inbox: each is
        # cancelled instead, and the loop's exit cancels what was left in it.
        self._lock = threading.Lock()
        self._closed = False
        self._accepting = True
        self._failure: str | None = None
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

    @property
    def failure(self) -> str | None:
        """Why the loop ended on an error (``None`` while it runs or after a clean drain)."""
        return self._failure

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
        params.check()
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
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; its outputs go to ``sink`` on the engine thread.

        Should the loop end before taking the request, ``sink`` gets ``"abort"`` on the
        calling thread.

        Args:
            request_id: Unique among the requests in flight.
            prompt_token_ids: The prompt.
            params: How to generate.
            sink: Gets the request's outputs.
            cache_salt: Hashed into the first block's hash (vLLM's ``cache_salt``), so
                only requests with the same salt share cached blocks.

        Raises:
            InvalidRequestError: The request could never be served.
            EngineClosedError: The engine is draining or stopped.
        """
        self.validate(prompt_token_ids, params)
        if not self._accepting:
            raise EngineClosedError("the worker is shutting down and takes no new requests")
        request = self.kv.make_request(request_id, prompt_token_ids, cache_salt=cache_salt)
        generator = params.make_generator(self.model.device)
        seq = _Sequence(request, params=params, sink=sink, generator=generator)
        self._put(
            _Job(
                lambda: self._scheduler.add(seq),
                cancel=lambda: self._deliver(seq, self._output(seq, [], "abort")),
            )
        )

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its client went away); its sink gets ``"abort"``."""
        self._put(_Job(lambda: self._abort(request_id)))

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread between two steps.

        Returns:
            A future with ``fn``'s result or exception; :class:`EngineClosedError` when
            the loop has ended (or ends) before running it.
        """
        future: Future[T] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

        def cancel() -> None:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineClosedError("the engine loop has stopped"))

        self._put(_Job(run, cancel))
        return future

    def start(self) -> None:
        """Run the loop on a background thread."""
        self._thread = threading.Thread(target=self._run, name="kvroute-engine", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Take no new requests; the loop exits once every queued request has finished."""
        self._accepting = False
        self._put(_Job(lambda: None))  # wake the loop

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Drain, then wait for the loop thread to exit.

        Returns:
            True when the thread exited within ``timeout_s``.
        """
        self.drain()
        return self.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the loop thread to exit (after a drain, or when it fails).

        Returns:
            True when the thread is not running any more.
        """
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.is_running

    # ----------------------------------------------------- engine thread (or tests)

    @property
    def has_work(self) -> bool:
        """Whether any request is running or waiting."""
        return self._scheduler.has_work

    def stats(self) -> EngineStats:
        """Load and counters; call on the engine thread (through :meth:`call`)."""
        pool = self.kv.block_pool
        scheduler = self._scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_free_blocks=pool.get_num_free_blocks(),
            num_usable_blocks=pool.num_gpu_blocks - 1,
            usage=pool.get_usage(),
            prefix_query_tokens=scheduler.prefix_query_tokens,
            prefix_hit_tokens=scheduler.prefix_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self._num_steps,
            num_batches_published=self._num_batches - self._num_dropped,
            num_batches_dropped=self._num_dropped,
            queued_prefill_tokens=scheduler.queued_prefill_tokens,
            decode_tokens=sum(
                seq.params.max_tokens - len(seq.request.output_token_ids)
                for seq in (*scheduler.running, *scheduler.waiting)
            ),
            num_failures=dict(self._failures),
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
        job.run()
        while True:
            try:
                self._inbox.get_nowait().run()
            except queue.Empty:
                return

    def step(self) -> None:
        """Schedule, compute and sample one step, then publish its events."""
        started = time.perf_counter()
        scheduled = self._scheduler.schedule()
        if scheduled:
            self._execute(scheduled)
        self._publish_events()
        self._num_steps += 1
        if self.step_observer is not None:
            self.step_observer(time.perf_counter() - started)

    def _put(self, job: _Job) -> None:
        with self._lock:
            if not self._closed:
                self._inbox.put(job)
                return
        job.cancel()

    def _run(self) -> None:
        try:
            while True:
                self.run_inbox(block=not self.has_work)
                if self.has_work:
                    self.step()
                elif not self._accepting:
                    return
        except Exception as exc:
            # The thread ends here: is_running turns False, which the worker watches.
            logger.exception("engine loop failed; the worker stops serving")
            self._failure = f"the engine loop failed: {type(exc).__name__}: {exc}"
            self._accepting = False
            for seq in [*self._scheduler.running, *self._scheduler.waiting]:
                self._deliver(seq, self._output(seq, [], "abort"))
        finally:
            with self._lock:
                self._closed = True
            while True:
                try:
                    self._inbox.get_nowait().cancel()
                except queue.Empty:
                    break

    def _execute(self, scheduled: list[_Sequence]) -> None:
        logits, scheduled = self._forward(scheduled)
        rows: list[int] = []
        for row, seq in enumerate(scheduled):
            seq.request.num_computed_tokens += seq.num_scheduled_tokens
            # A prefill chunk that leaves prompt tokens uncomputed samples nothing.
            if seq.request.num_computed_tokens == seq.request.num_tokens:
                rows.append(row)
        if not rows:
            return
        sampling = [scheduled[row] for row in rows]
        tokens = self._sampler.sample(
            logits[rows], [seq.params for seq in sampling], [seq.generator for seq in sampling]
        )
        for row, seq, token in zip(rows, sampling, tokens, strict=True):
            if isinstance(token, SamplingError):
                self._fail(seq, "sampling", token)
                continue
            try:
                num_top = seq.params.logprobs
                logprobs = None if num_top is None else token_logprobs(logits[row], token, num_top)
                self._append(seq, token, logprobs)
            except Exception as exc:
                self._fail(seq, "engine", exc)

    def _forward(self, scheduled: list[_Sequence]) -> tuple[torch.Tensor, list[_Sequence]]:
        """The logits of ``scheduled``; requests whose forward pass raises are failed.

        Returns:
            The logits of the requests that computed, and those requests, in order.
        """
        items = [self._forward_item(seq) for seq in scheduled]
        try:
            return self.model.forward_paged(items, self.cache), scheduled
        except Exception as exc:
            if len(items) == 1:
                self._fail(scheduled[0], "forward", exc)
                return torch.empty(0), []
            logger.warning(
                "a forward pass over %d requests failed (%s: %s); computing them one by one "
                "to fail only the request that causes it",
                len(items),
                type(exc).__name__,
                exc,
            )
        # Rewriting the K/V slots the failed pass may have written is harmless: the same
        # tokens at the same positions give the same values.
        rows: list[torch.Tensor] = []
        computed: list[_Sequence] = []
        for seq, item in zip(scheduled, items, strict=True):
            try:
                rows.append(self.model.forward_paged([item], self.cache))
            except Exception as exc:
                self._fail(seq, "forward", exc)
            else:
                computed.append(seq)
        return (torch.cat(rows) if rows else torch.empty(0)), computed

    def _forward_item(self, seq: _Sequence) -> ForwardItem:
        request = seq.request
        start = request.num_computed_tokens
        return ForwardItem(
            request.all_token_ids[start : start + seq.num_scheduled_tokens],
            start,
            self.kv.get_block_ids(request.request_id),
        )

    def _append(self, seq: _Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        request = seq.request
        request.append_output_token_ids(token)
        reason = None
        if token == self.eos_token_id and not seq.params.ignore_eos:
            reason = "stop"
        elif len(request.output_token_ids) >= seq.params.max_tokens:
            reason = "length"
        if reason is not None:
            self._scheduler.finish(seq)
        out = self._output(seq, [token], reason)
        if logprobs is not None:
            out = dataclasses.replace(out, logprobs=(logprobs,))
        seq.sink(out)

    def _fail(self, seq: _Sequence, stage: str, exc: Exception) -> None:
        """End one request with ``"error"``: release its blocks, count it, tell its sink."""
        request_id = seq.request.request_id
        # A sampling error is fully described by its message; anything else is a surprise.
        logger.error(
            "request %s failed in %s: %s",
            request_id,
            stage,
            exc,
            exc_info=None if isinstance(exc, SamplingError) else exc,
        )
        if seq in self._scheduler.running:  # not when it failed after finishing
            self._scheduler.discard(seq)
        self._failures[stage] += 1
        failure = RequestFailure(stage, f"{type(exc).__name__}: {exc}")
        self._deliver(seq, self._output(seq, [], "error", failure))

    def _deliver(self, seq: _Sequence, out: RequestOutput) -> None:
        """Hand ``out`` to the request's sink; a sink that raises loses only its output."""
        try:
            seq.sink(out)
        except Exception:
            logger.exception("the output sink of request %s failed", out.request_id)

    def _abort(self, request_id: str) -> None:
        seq = self._scheduler.remove(request_id)
        if seq is not None:
            self._deliver(seq, self._output(seq, [], "abort"))

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
    def _output(
        seq: _Sequence,
        tokens: list[int],
        reason: str | None,
        failure: RequestFailure | None = None,
    ) -> RequestOutput:
        request = seq.request
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_output_tokens=len(request.output_token_ids),
            failure=failure,
        )
