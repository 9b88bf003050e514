"""Mooncake-format traces as simulator requests, and the infinite-cache ideal of a trace.

A trace (read with :func:`router.workload.read_trace`) gives each request's arrival in
milliseconds, its prompt and output lengths and one id per 512-token block, equal ids
meaning a reusable prefix; the last block may be partial. The simulator needs token ids
that keep exactly that prefix structure: block ``j`` of a request becomes 512 copies of
its id, so equal ids give equal tokens and, keys being chained, equal prefixes give
equal keys (and different prefixes different keys, even for equal ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from router.cluster.workload import TRACE_BLOCK_TOKENS, TraceRecord, read_trace
from router.errors import RouterError

__all__ = [
    "HitRates",
    "IdealHits",
    "SimError",
    "SimRequest",
    "ideal_hits",
    "load_trace",
    "to_requests",
]

_MAX_TOKEN: Final = 0xFFFF_FFFF


class SimError(RouterError, ValueError):
    """A simulation input or setting is invalid."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One trace request, as the simulator replays it.

    Attributes:
        index: Position in the trace (unique, used as request id).
        arrival_s: Arrival in trace seconds after the first request (before ``--speed``).
        num_prompt_tokens: Prompt length.
        num_output_tokens: Tokens to generate.
        hash_ids: The trace's block ids (512 tokens each, the last one maybe partial).
    """

    index: int
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    hash_ids: tuple[int, ...]

    def token_ids(self) -> list[int]:
        """The prompt: each trace block's id repeated 512 times, cut to the prompt length."""
        tokens: list[int] = []
        for hash_id in self.hash_ids:
            tokens += [hash_id] * TRACE_BLOCK_TOKENS
        del tokens[self.num_prompt_tokens :]
        return tokens


def to_requests(records: Sequence[TraceRecord]) -> list[SimRequest]:
    """Validate trace records and turn them into requests (arrivals from the first one).

    Raises:
        SimError: A record's block count does not match its length, an id does not fit a
            32-bit token, or timestamps go backwards.
    """
    out: list[SimRequest] = []
    start_ms = records[0].timestamp if records else 0
    last_ms = start_ms
    for i, r in enumerate(records):
        expected = -(-r.input_length // TRACE_BLOCK_TOKENS)
        if len(r.hash_ids) != expected or r.output_length < 0:
            raise SimError(
                f"trace record {i}: {len(r.hash_ids)} hash_ids for input_length "
                f"{r.input_length} (expected ceil(input_length / {TRACE_BLOCK_TOKENS}) = "
                f"{expected}) and output_length {r.output_length} (expected >= 0)"
            )
        if any(not 0 <= h <= _MAX_TOKEN for h in r.hash_ids):
            raise SimError(f"trace record {i}: hash ids must fit in 32 bits, got {r.hash_ids}")
        if r.timestamp < last_ms:
            raise SimError(
                f"trace record {i}: timestamp {r.timestamp} ms is before the previous "
                f"{last_ms} ms; sort the trace by timestamp"
            )
        last_ms = r.timestamp
        out.append(
            SimRequest(
                index=i,
                arrival_s=(r.timestamp - start_ms) / 1000.0,
                num_prompt_tokens=r.input_length,
                num_output_tokens=r.output_length,
                hash_ids=tuple(r.hash_ids),
            )
        )
    return out


def load_trace(path: str | Path, limit: int | None = None) -> list[SimRequest]:
    """Read a Mooncake-format trace file into requests.

    Args:
        path: The JSONL trace.
        limit: Keep only the first ``limit`` requests (``None``: all).

    Raises:
        router.cluster.workload.WorkloadError: The file is missing or a line is malformed.
        SimError: A record is inconsistent (see :func:`to_requests`).
    """
    records = read_trace(path)
    return to_requests(records if limit is None else records[:limit])


class HitRates:
    """Hit rates of counts in trace blocks and prompt tokens (a base of the classes that
    hold those counts: an ideal, a bound, a policy's result)."""

    __slots__ = ()

    num_blocks: int
    num_hit_blocks: int
    num_tokens: int
    num_hit_tokens: int

    @property
    def hit_rate_blocks(self) -> float:
        """Hit trace blocks over all trace blocks."""
        return self.num_hit_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate_tokens(self) -> float:
        """Hit prompt tokens over all prompt tokens."""
        return self.num_hit_tokens / self.num_tokens if self.num_tokens else 0.0


@dataclass(frozen=True, slots=True)
class IdealHits(HitRates):
    """What one infinite prefix cache would serve from cache, in trace blocks and tokens.

    A block counts when it and every block before it in its request appeared in an
    earlier request; no routing over any number of finite workers can do better.
    """

    num_blocks: int
    num_hit_blocks: int
    num_tokens: int
    num_hit_tokens: int


def ideal_hits(requests: Sequence[SimRequest]) -> IdealHits:
    """The infinite-cache ideal of a trace, counted on its own block ids."""
    seen: set[int] = set()
    hit_blocks = hit_tokens = blocks = tokens = 0
    for r in requests:
        depth = 0
        for hash_id in r.hash_ids:
            if hash_id not in seen:
                break
            depth += 1
        hit_blocks += depth
        hit_tokens += min(depth * TRACE_BLOCK_TOKENS, r.num_prompt_tokens)
        blocks += len(r.hash_ids)
        tokens += r.num_prompt_tokens
        seen.update(r.hash_ids)
    return IdealHits(blocks, hit_blocks, tokens, hit_tokens)
