"""Event streams under test: a recording sink, recognisable batches, handshakes.

Shared by the publisher, subscriber, recorder and CURVE tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from events.endpoints import Endpoint
from events.publisher import EventPublisher, PublisherConfig
from events.schema import BlockStored, KVEventBatch
from events.subscriber import ReceivedBatch

DEADLINE_S = 30.0
"""Upper bound of every wait: generous, as tests share a loaded 2-core machine."""


def batch(n: int, *, num_blocks: int = 1, block_size: int = 4) -> KVEventBatch:
    """A batch whose single BlockStored is recognisable by ``n``."""
    hashes: list[int | bytes] = [n * 1000 + i for i in range(num_blocks)]
    return KVEventBatch(
        ts=1_700_000_000.0 + n,
        events=[
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=list(range(num_blocks * block_size)),
                block_size=block_size,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
        data_parallel_rank=0,
    )


def batch_id(received: ReceivedBatch) -> int:
    """The ``n`` a :func:`batch` was made from."""
    event = received.batch.events[0]
    assert isinstance(event, BlockStored)
    first = event.block_hashes[0]
    assert isinstance(first, int)
    return first // 1000


def loopback_publisher(
    *, replay: bool = True, skip_live_seqs: set[int] | None = None, **config: Any
) -> EventPublisher:
    """A publisher bound to OS-chosen loopback ports."""
    return EventPublisher(
        PublisherConfig(
            endpoint=Endpoint.binding("tcp://127.0.0.1:*"),
            replay_endpoint=Endpoint.binding("tcp://127.0.0.1:*") if replay else None,
            **config,
        ),
        skip_live_seqs=skip_live_seqs if skip_live_seqs is not None else set(),
    )


@dataclass
class RecordingSink:
    """An EventSink that records every call in order and wakes waiters on each."""

    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    batches: list[ReceivedBatch] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_batch(self, received: ReceivedBatch) -> None:
        self.batches.append(received)
        self.calls.append(("batch", received.worker_id, received.seq))
        self.changed.set()

    async def on_reset(self, worker_id: str, seq: int) -> None:
        self.calls.append(("reset", worker_id, seq))
        self.changed.set()

    async def on_resync_needed(self, worker_id: str, reason: str) -> None:
        self.calls.append(("resync", worker_id, reason))
        self.changed.set()

    def seqs(self, worker_id: str) -> list[int]:
        return [b.seq for b in self.batches if b.worker_id == worker_id]

    async def wait_for(
        self,
        predicate: Callable[[], bool],
        *,
        timeout_s: float = DEADLINE_S,
        poke: Callable[[], object] | None = None,
        poke_every_s: float = 0.05,
    ) -> None:
        """Wait until ``predicate()`` holds, calling ``poke()`` (e.g. publish a probe)
        whenever nothing changed for ``poke_every_s``. Fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"condition not met within {timeout_s} s; calls={self.calls[-5:]}"
            if poke is not None:
                poke()
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(poke_every_s, remaining))


async def handshake(sink: RecordingSink, worker_id: str, probe: Callable[[], object]) -> int:
    """Publish probes until ``worker_id``'s first batch arrives (the slow-joiner fix).

    Returns:
        The seq of the last batch delivered for the worker once the probes are seen.
    """
    await sink.wait_for(lambda: bool(sink.seqs(worker_id)), poke=probe)
    return sink.seqs(worker_id)[-1]
