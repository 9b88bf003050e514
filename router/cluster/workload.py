"""Workloads that drive a cluster: Mooncake-format trace records as token ids, or chats.

The Mooncake trace format (``timestamp`` in ms, ``input_length``, ``output_length``,
``hash_ids``, one id per 512-token block, chained: equal ids mean a reusable prefix) has no
token ids. :func:`block_tokens` derives each trace block's tokens deterministically from its
id, so equal ids give equal tokens and prefixes stay consistent; ``block_scale`` tokens
stand for each 512-token trace block, which shrinks the work enough for small CPU workers
while keeping the trace's prefix structure. Which trace (a file or the built-in generator)
is :mod:`router.cluster.trace_source`'s decision.

The chat workload is the other choice: sessions that share a few system prompts, each
turn's prompt being the whole conversation so far.

Token ids stay below 256, so every workload runs on the byte-level vocabulary that kvroute
workers use by default.
"""

from __future__ import annotations

import math
import random
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from events.hashing import root_key, router_block_keys
from router.errors import RouterError

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "WORKLOAD_NAMES",
    "TraceRecord",
    "Workload",
    "WorkloadError",
    "WorkloadRequest",
    "block_tokens",
    "chat_workload",
    "ideal_hit_tokens",
    "lru_prefix_depths",
    "pooled_lru_hit_tokens",
    "read_trace",
    "select_families",
    "trace_requests",
]

TRACE_BLOCK_TOKENS: Final = 512
"""Tokens per block in Mooncake traces."""

WORKLOAD_NAMES: Final = ("mooncake", "chat")
"""Names of the built-in workloads, the first being the default."""

_TOKEN_SPACE: Final = 256  # byte-level ids: valid for every vocabulary kvroute ships


class WorkloadError(RouterError, ValueError):
    """A trace cannot be read, or a workload's parameters are out of range."""


class TraceRecord(msgspec.Struct, frozen=True):
    """One request of a Mooncake-format trace.

    NOTE: ``len(hash_ids) == ceil(input_length / 512)``; the last block may be partial.
    """

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload.

    Attributes:
        arrival_s: Seconds after the workload's first request that it arrives.
        token_ids: The prompt.
        max_tokens: Tokens to generate.
        session: The prefix family (trace) or conversation (chat) it belongs to.
    """

    arrival_s: float
    token_ids: tuple[int, ...]
    max_tokens: int
    session: str


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, ordered list of requests.

    Attributes:
        name: What it is, e.g. ``"mooncake"``.
        description: One line saying how it was built (for reports).
        requests: The requests in arrival order.
    """

    name: str
    description: str
    requests: tuple[WorkloadRequest, ...]

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Tokens to generate over all requests."""
        return sum(r.max_tokens for r in self.requests)


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Read a Mooncake-format JSONL trace.

    Raises:
        WorkloadError: The file is missing or a line is not a valid trace record.
    """
    decoder = msgspec.json.Decoder(TraceRecord)
    records: list[TraceRecord] = []
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(decoder.decode(line))
                except msgspec.DecodeError as exc:
                    raise WorkloadError(f"{path}:{lineno}: not a trace record ({exc})") from exc
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {str(path)!r} ({exc.strerror})") from exc
    return records


def block_tokens(hash_id: int, num_tokens: int, seed: int = 0) -> list[int]:
    """The token ids that stand for one trace block.

    Args:
        hash_id: The block's id in the trace.
        num_tokens: How many tokens to produce; a prefix of a longer call's result.
        seed: Workload seed; different seeds give unrelated tokens.

    Returns:
        ``num_tokens`` ids in ``[0, 256)``, a pure function of the arguments.
    """
    # String seeds are hashed with SHA-512 by ``random``: stable across runs and versions.
    rng = random.Random(f"kvroute-trace-block:{seed}:{hash_id}")
    return list(rng.randbytes(num_tokens))


def select_families(
    records: Sequence[TraceRecord], num_families: int, num_requests: int
) -> list[TraceRecord]:
    """A slice of a trace that keeps its prefix reuse.

    Reuse in a trace is long-range: a contiguous window of a few hundred requests shares
    almost nothing. This slice takes the ``num_families`` prefix families (requests with
    the same first block) that have the most requests, and the first ``num_requests`` of
    their requests in trace order.

    Raises:
        WorkloadError: A count is not positive.
    """
    if num_families <= 0 or num_requests <= 0:
        raise WorkloadError(
            f"num_families and num_requests must be positive, got {num_families}, {num_requests}"
        )
    sizes = Counter(r.hash_ids[0] for r in records if r.hash_ids)
    # most_common keeps first-seen order among equal counts, so the slice is deterministic.
    chosen = {root for root, _ in sizes.most_common(num_families)}
    return [r for r in records if r.hash_ids and r.hash_ids[0] in chosen][:num_requests]


def trace_requests(
    records: Sequence[TraceRecord],
    *,
    block_scale: int,
    max_output_tokens: int,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Turn trace records into requests with token ids, scaled down.

    Args:
        records: The records, in arrival order.
        block_scale: Tokens standing for one 512-token trace block; a partial last block
            keeps its proportion (rounded up). Output lengths are scaled the same way.
        max_output_tokens: Upper bound on any request's ``max_tokens``.
        seed: Workload seed for :func:`block_tokens`.

    Returns:
        One request per record; arrivals relative to the first record.

    Raises:
        WorkloadError: ``block_scale`` or ``max_output_tokens`` is not positive.
    """
    if block_scale <= 0 or max_output_tokens <= 0:
        raise WorkloadError(
            f"block_scale and max_output_tokens must be positive, got {block_scale}, "
            f"{max_output_tokens}"
        )
    cache: dict[int, list[int]] = {}
    start_ms = records[0].timestamp if records else 0
    out: list[WorkloadRequest] = []
    for record in records:
        tokens: list[int] = []
        for hash_id in record.hash_ids:
            block = cache.get(hash_id)
            if block is None:
                block = cache[hash_id] = block_tokens(hash_id, block_scale, seed)
            tokens += block
        remainder = record.input_length - TRACE_BLOCK_TOKENS * (len(record.hash_ids) - 1)
        if record.hash_ids and 0 < remainder < TRACE_BLOCK_TOKENS:
            keep = math.ceil(remainder * block_scale / TRACE_BLOCK_TOKENS)
            del tokens[len(tokens) - block_scale + keep :]
        output = math.ceil(record.output_length * block_scale / TRACE_BLOCK_TOKENS)
        out.append(
            WorkloadRequest(
                arrival_s=(record.timestamp - start_ms) / 1000.0,
                token_ids=tuple(tokens),
                max_tokens=max(1, min(max_output_tokens, output)),
                session=f"family-{record.hash_ids[0] if record.hash_ids else 'empty'}",
            )
        )
    return out


def chat_workload(
    *,
    num_sessions: int = 24,
    num_turns: int = 4,
    num_system_prompts: int = 3,
    system_tokens: int = 256,
    user_tokens: int = 48,
    reply_tokens: int = 32,
    max_output_tokens: int = 8,
    turn_gap_s: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Multi-turn conversations sharing a few system prompts.

    Turn ``t`` of a session sends the system prompt, then for every earlier turn its user
    message and a reply, then the new user message. Replies are synthetic (the worker's
    real output is not fed back), so the workload is a fixed list. Requests come turn by
    turn: every session's turn 0, then every session's turn 1 (in another order), and so on.

    Args:
        num_sessions: Conversations.
        num_turns: Requests per conversation.
        num_system_prompts: Distinct system prompts; session ``s`` uses ``s % n``.
        system_tokens: Length of each system prompt.
        user_tokens: Length of each user message.
        reply_tokens: Length of each reply placed in the history.
        max_output_tokens: ``max_tokens`` of every request.
        turn_gap_s: Seconds between two turns of one session.
        seed: Seed of the token ids.

    Raises:
        WorkloadError: A count or length is not positive.
    """
    sizes = (num_sessions, num_turns, num_system_prompts, system_tokens, user_tokens)
    if min(sizes) <= 0 or reply_tokens < 0 or max_output_tokens <= 0:
        raise WorkloadError(f"chat workload sizes must be positive, got {sizes}")
    rng = random.Random(f"kvroute-chat:{seed}")
    systems = [list(rng.randbytes(system_tokens)) for _ in range(num_system_prompts)]
    histories = [list(systems[s % num_system_prompts]) for s in range(num_sessions)]
    spacing_s = turn_gap_s / num_sessions
    requests: list[WorkloadRequest] = []
    for turn in range(num_turns):
        # Conversations answer at their own pace: a new order each turn, so that a blind
        # rotation over W workers does not keep each conversation on one worker by chance.
        order = list(range(num_sessions))
        rng.shuffle(order)
        for position, session in enumerate(order):
            history = histories[session]
            history += rng.randbytes(user_tokens)
            requests.append(
                WorkloadRequest(
                    arrival_s=turn * turn_gap_s + position * spacing_s,
                    token_ids=tuple(history),
                    max_tokens=max_output_tokens,
                    session=f"chat-{session}",
                )
            )
            history += rng.randbytes(reply_tokens)
    return Workload(
        name="chat",
        description=(
            f"{num_sessions} chats x {num_turns} turns over {num_system_prompts} system "
            f"prompts of {system_tokens} tokens"
        ),
        requests=tuple(requests),
    )


def ideal_hit_tokens(prompts: Iterable[Sequence[int]], block_size: int) -> int:
    """Prompt tokens one infinite prefix cache would serve from cache.

    A block counts when it and every block before it appeared in an earlier prompt, the
    bound no routing policy over any number of workers can beat.

    Args:
        prompts: Prompts in arrival order.
        block_size: Tokens per cache block.
    """
    seen: set[int] = set()
    root = root_key()
    hits = 0
    for prompt in prompts:
        keys = router_block_keys(prompt, block_size, root)
        matched = 0
        while matched < len(keys) and keys[matched] in seen:
            matched += 1
        hits += matched * block_size
        seen.update(keys)
    return hits


def lru_prefix_depths(requests: Iterable[Sequence[Hashable]], capacity_blocks: int) -> list[int]:
    """Per request, its prefix hit in blocks on one LRU cache of ``capacity_blocks``.

    Args:
        requests: Each request's block ids from block 0, in arrival order (an id names the
            block together with its whole prefix, as trace ids and router keys do).
        capacity_blocks: Blocks the cache holds; at least 1.

    Returns:
        One depth per request: how many of its leading blocks were cached on arrival.

    Raises:
        WorkloadError: ``capacity_blocks`` is below 1.
    """
    if capacity_blocks < 1:
        raise WorkloadError(f"a pooled LRU cache needs at least 1 block, got {capacity_blocks}")
    cache: OrderedDict[Hashable, None] = OrderedDict()
    depths: list[int] = []
    for blocks in requests:
        depth = 0
        for block in blocks:
            if block not in cache:
                break
            depth += 1
        depths.append(depth)
        # Touched last to first: a request's tail becomes older than its head, as vLLM
        # frees a finished request's blocks tail first, so a chain is evicted from its end.
        for block in reversed(blocks):
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return depths


def pooled_lru_hit_tokens(
    prompts: Iterable[Sequence[int]], block_size: int, capacity_blocks: int
) -> int:
    """Prompt tokens one LRU prefix cache of ``capacity_blocks`` blocks would serve.

    The counterpart of :func:`ideal_hit_tokens` for a finite cache (the pooled-LRU bound,
    see :mod:`router.sim.bounds`):
    prompts are keyed in blocks of ``block_size`` as the router keys them.

    Args:
        prompts: Prompts in arrival order.
        block_size: Tokens per cache block.
        capacity_blocks: The cluster's blocks (workers x blocks per worker).

    Raises:
        WorkloadError: ``capacity_blocks`` is below 1.
    """
    root = root_key()
    chains = (router_block_keys(prompt, block_size, root) for prompt in prompts)
    return sum(lru_prefix_depths(chains, capacity_blocks)) * block_size
