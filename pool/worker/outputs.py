"""What the engine hands back: per-step request outputs, load statistics, cache snapshots."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pool.snapshot import ChainRun

__all__ = [
    "EngineStats",
    "OutputSink",
    "RequestFailure",
    "RequestOutput",
    "Snapshot",
    "TokenLogprobs",
]


@dataclass(frozen=True)
class TokenLogprobs:
    """The log probabilities reported with one sampled token.

    Attributes:
        token_id: The sampled token.
        logprob: Its log probability.
        top: ``(token id, log probability)`` of the likeliest tokens, likeliest first
            (as many as the request asked for; the sampled one may be among them).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestFailure:
    """Why the engine failed one request (the others and the engine went on).

    Attributes:
        stage: Where it failed, a short metric label: ``"forward"`` (the model's forward
            pass for this request alone), ``"sampling"`` (its logits could not be
            sampled) or ``"engine"`` (handling its output).
        message: What happened, for the client and the log.
    """

    stage: str
    message: str


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        request_id: The request.
        new_token_ids: Tokens generated in this step (empty when only finishing).
        finish_reason: ``"stop"`` (end of sequence), ``"length"`` (``max_tokens``),
            ``"abort"`` (aborted, or the engine stopped), ``"error"`` (this request failed:
            see ``failure``), or ``None`` while running.
        num_prompt_tokens: Prompt length.
        num_cached_tokens: Prompt tokens found in the prefix cache at first admission.
        num_output_tokens: Tokens generated so far.
        failure: Why the request failed, with ``finish_reason == "error"`` only.
        logprobs: One entry per token of ``new_token_ids`` when the request asked for
            logprobs, else ``None``.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    failure: RequestFailure | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def finished(self) -> bool:
        """Whether this is the request's last output."""
        return self.finish_reason is not None


OutputSink = Callable[[RequestOutput], None]
"""Called on the engine thread with each output; must not block."""


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
        queued_prefill_tokens: Prompt tokens still to compute: waiting requests' cache
            misses and running chunked prefills' remainders.
        decode_tokens: Tokens still to generate by running and waiting requests, at most.
        num_failures: Requests the engine failed, by :attr:`RequestFailure.stage`.
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
    queued_prefill_tokens: int
    decode_tokens: int
    num_failures: Mapping[str, int] = field(default_factory=dict)


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
