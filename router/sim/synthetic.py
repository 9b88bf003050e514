"""Synthetic Mooncake-format traces for capacity studies: shifted copies, generated chats.

Routing against the pooled-LRU bound (:mod:`router.sim.bounds`) needs traces whose working
set is several times the cluster's cache, and more than one kind of them:

* :func:`shifted_copies` keeps a real trace's statistics and multiplies its working set:
  ``k`` copies, each with its own block ids, stretched ``k`` times in time (so the arrival
  rate stays the original's) and offset by ``1/k`` of their length.
* :func:`chat_sessions` generates multi-turn conversations over shared system prompts of
  Zipf popularity: a few system prompts carry most sessions (the hot-prefix case), every
  turn's prompt is the whole conversation so far (long private prefixes), and block ids
  come from the blocks' contents, so a partial last block is not the block the next turn
  completes (an engine never caches partial blocks).

Both return :class:`router.cluster.workload.TraceRecord` lists in arrival order;
:func:`write_trace` saves them as JSON lines for ``kvroute sim --trace``.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from pathlib import Path

import msgspec

from router.cluster.workload import TRACE_BLOCK_TOKENS, TraceRecord
from router.sim.trace import SimError

__all__ = ["chat_sessions", "shifted_copies", "write_trace"]


def shifted_copies(records: Sequence[TraceRecord], copies: int) -> list[TraceRecord]:
    """``copies`` interleaved copies of a trace, each with its own block ids.

    Copy ``k`` has every id offset by ``k * (max id + 1)`` and its timestamps stretched
    ``copies`` times and shifted by ``k / copies`` of the stretched length: the working
    set is ``copies`` times the original's, the arrival rate at most the original's.

    Raises:
        SimError: ``copies`` is below 1, or the ids would not fit in 32 bits.
    """
    if copies < 1:
        raise SimError(f"copies must be >= 1, got {copies}")
    if not records:
        return []
    start_ms = records[0].timestamp
    span_ms = records[-1].timestamp - start_ms
    offset = max((h for r in records for h in r.hash_ids), default=-1) + 1
    if copies * offset > 2**32:
        raise SimError(f"{copies} copies of ids up to {offset - 1} do not fit in 32 bits")
    out = [
        TraceRecord(
            copies * (r.timestamp - start_ms) + k * span_ms,
            r.input_length,
            r.output_length,
            [h + k * offset for h in r.hash_ids],
        )
        for k in range(copies)
        for r in records
    ]
    out.sort(key=lambda r: r.timestamp)  # stable: ties keep copy order
    return out


class _BlockIds:
    """Block ids from block contents: equal chains of contents get equal ids.

    A block's content is a tuple of ``(segment, start, end)`` token ranges; its id names
    it together with its parent block's id, as trace ids name whole prefixes.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple[int | None, tuple[Hashable, ...]], int] = {}

    def chain(self, segments: Sequence[tuple[Hashable, int]]) -> list[int]:
        """The ids of the blocks of ``segments`` (``(segment id, length)``), last maybe partial."""
        out: list[int] = []
        parent: int | None = None
        chunk: list[tuple[Hashable, int, int]] = []
        filled = 0
        for segment, length in segments:
            pos = 0
            while pos < length:
                take = min(TRACE_BLOCK_TOKENS - filled, length - pos)
                chunk.append((segment, pos, pos + take))
                filled += take
                pos += take
                if filled == TRACE_BLOCK_TOKENS:
                    parent = self._ids.setdefault((parent, tuple(chunk)), len(self._ids))
                    out.append(parent)
                    chunk, filled = [], 0
        if chunk:
            out.append(self._ids.setdefault((parent, tuple(chunk)), len(self._ids)))
        return out


def chat_sessions(
    *,
    num_sessions: int = 1500,
    session_gap_s: float = 0.7,
    num_system_prompts: int = 40,
    zipf_exponent: float = 1.1,
    mean_turns: float = 3.0,
    max_turns: int = 12,
    think_s: float = 20.0,
    seed: int = 7,
) -> list[TraceRecord]:
    """Multi-turn conversations over shared system prompts, as a Mooncake-format trace.

    Sessions start as a Poisson process (``session_gap_s`` apart on average) and pick a
    system prompt (1,024 to 6,144 tokens) with probability ``1 / rank ** zipf_exponent``.
    A session has ``1 + Exp(mean_turns)`` turns (at most ``max_turns``); each adds a user
    message of 100 to 1,500 tokens, asks for 50 to 400 output tokens, and the reply is
    part of the next turn's prompt, which comes ``Exp(think_s)`` seconds later.

    Raises:
        SimError: A count or duration is not positive.
    """
    sizes = (num_sessions, num_system_prompts, max_turns)
    if min(sizes) < 1 or not (session_gap_s > 0 and mean_turns > 0 and think_s > 0):
        raise SimError(f"chat session settings must be positive, got {sizes}")
    rng = random.Random(f"kvroute-chat-sessions:{seed}")
    ids = _BlockIds()
    system_tokens = [rng.choice((1024, 2048, 3072, 4096, 6144)) for _ in range(num_system_prompts)]
    popularity = [1.0 / (rank + 1) ** zipf_exponent for rank in range(num_system_prompts)]
    records: list[TraceRecord] = []
    start_s = 0.0
    segment = 0
    for _ in range(num_sessions):
        start_s += rng.expovariate(1.0 / session_gap_s)
        system = rng.choices(range(num_system_prompts), popularity)[0]
        segments: list[tuple[Hashable, int]] = [(("system", system), system_tokens[system])]
        at_s = start_s
        for _ in range(min(1 + int(rng.expovariate(1.0 / mean_turns)), max_turns)):
            segment += 1
            segments.append((("user", segment), rng.randint(100, 1500)))
            output = rng.randint(50, 400)
            records.append(
                TraceRecord(
                    int(at_s * 1000),
                    sum(length for _, length in segments),
                    output,
                    ids.chain(segments),
                )
            )
            segment += 1
            segments.append((("reply", segment), output))
            at_s += rng.expovariate(1.0 / think_s)
    records.sort(key=lambda r: r.timestamp)
    return records


def write_trace(path: str | Path, records: Sequence[TraceRecord]) -> None:
    """Write records as a Mooncake-format JSONL trace (``kvroute sim --trace`` reads it).

    Raises:
        OSError: The file cannot be written.
    """
    encoder = msgspec.json.Encoder()
    with open(path, "wb") as f:
        for record in records:
            f.write(encoder.encode(record) + b"\n")
