"""The ``PrefixIndex`` seam: what every global prefix index implementation offers.

An index maps router keys (chained per-block keys, see :mod:`events.hashing`) to the
workers that hold them and on which medium. Implementations: ``MemoryPrefixIndex``
(simulator and tests) and ``RedisPrefixIndex`` (production). One contract test suite
runs against both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from events.hashing import BlockKey
from events.identity import WorkerId
from events.schema import KVEventBatch

__all__ = ["IndexStats", "PrefixIndex", "PrefixMatch"]


class PrefixMatch(msgspec.Struct, frozen=True, gc=False):
    """The longest consecutive prefix of a request's keys that one worker holds.

    NOTE: ``num_gpu_blocks + num_cpu_blocks == num_blocks``: a block counts as GPU when the
    worker holds it on ``"GPU"`` (or an unspecified medium), else as CPU (any other medium).
    The prefix stops at the first block the worker holds on no medium.
    """

    num_blocks: int = 0
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0

    def weighted_tokens(self, block_size: int, cpu_weight: float) -> float:
        """Tokens this prefix saves, CPU-tier blocks counted with ``cpu_weight``."""
        return block_size * (self.num_gpu_blocks + cpu_weight * self.num_cpu_blocks)


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Sizes of an index: entries are (key, worker, medium) triples."""

    num_entries: int
    num_keys: int
    num_workers: int
    memory_bytes: int | None = None


class PrefixIndex(Protocol):
    """A global prefix-hash index over many workers.

    Invariant: after ``apply`` of a worker's events in order, the entries of that worker
    equal the multiset of blocks its pool holds (duplicates reference-counted: an entry
    leaves only when its last copy is removed).
    """

    async def apply(self, worker_id: WorkerId, batch: KVEventBatch) -> None:
        """Apply one worker's event batch (engine hashes are bridged to router keys).

        Raises:
            OrphanParentError: A ``BlockStored`` names a parent this index has never seen
                for that worker; the events before it in the batch are applied, the rest
                are not. The caller replays or resyncs the worker.
        """
        ...

    async def lookup(
        self, keys: Sequence[BlockKey], workers: Sequence[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatch]:
        """Per candidate worker, the longest consecutive prefix of ``keys`` it holds.

        Args:
            keys: The request's router keys from block 0, all of one block size.
            workers: Candidates; ``None`` means every worker in the index.

        Returns:
            One entry per candidate that holds at least block 0; absent means no match.
        """
        ...

    async def clear_worker(self, worker_id: WorkerId) -> None:
        """Drop every entry (and engine-hash bridge) of one worker."""
        ...

    async def stats(self) -> IndexStats:
        """Current sizes of the index."""
        ...
