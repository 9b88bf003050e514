"""The ``PrefixIndex`` seam: what every global prefix index store offers.

An index maps router keys (chained per-block keys, see :mod:`events.hashing`) to the
workers that hold them and on which medium. A store writes :class:`~router.index.changes.Changes`
and knows nothing of engine hashes: the ingest folds KV events into changes through its
per-worker bridges (:mod:`router.ingest.bridged_index`). Stores: ``MemoryPrefixIndex``
(simulator and tests) and ``RedisPrefixIndex`` (production), either of which
``GroupCommitIndex`` (:mod:`router.index.group_commit`: the ingest's writes, queued and
sent together) can wrap. One contract test suite runs against all of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from events.hashing import BlockKey
from events.identity import WorkerId
from router.index.changes import Changes

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
    """A global prefix-hash index over many workers: a store of (key, worker, tier) entries.

    Invariant: after ``write`` of a worker's changes in order, the entries of that worker
    are the ``new`` masks of every key its changes touched (a key whose mask went to 0
    has no entry). Writers keep each worker's entries prefix-closed (a key has an entry
    only while every key before it in its chain has one, as the engine-hash bridge does):
    a store may find a match's depth by binary search. A shared store is fenced: only
    the holder of a worker's lease writes that worker's entries (:meth:`use_lease`); a
    store in one process has no other writer to fence off and takes any write.
    """

    def use_lease(self, worker_id: WorkerId, token: str) -> None:
        """Write the worker's entries under this lease token (``"<epoch>:<owner>"``)."""
        ...

    def forget_lease(self, worker_id: WorkerId) -> None:
        """Stop writing for the worker and drop its queued writes."""
        ...

    def changes_for(self, worker_id: WorkerId) -> Changes:
        """The changes to fold the worker's next write into, then give to :meth:`write`:
        new ones, or from a store that queues writes the worker's queued ones (valid
        until the caller's next ``await``).

        Raises:
            PrefixIndexError: The store does not write for the worker (no lease given).
            Exception: A store that queues writes: the worker's previous write failed
                (raised once).
        """
        ...

    async def write(self, worker_id: WorkerId, changes: Changes) -> None:
        """Write changes got from :meth:`changes_for` (a store that queues writes sends
        them soon).

        Raises:
            StaleLeaseError: The store refused the write: the lease is lost.
        """
        ...

    async def write_many(self, writes: Mapping[WorkerId, Changes]) -> Mapping[WorkerId, Exception]:
        """Write several workers' changes, each got from :meth:`changes_for`, together
        (one round trip where the store can); one worker's failure fails no other.

        Returns:
            The failure of each worker whose write failed (e.g. ``StaleLeaseError``).
        """
        ...

    async def flush(self, worker_id: WorkerId | None = None) -> None:
        """Wait for the queued writes of a worker (or all); at once for a store that
        writes at once.

        Raises:
            StaleLeaseError: A queued write was refused: the lease is lost.
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
        """Drop every entry of one worker (also those written before a restart)."""
        ...

    async def worker_entries(self, worker_id: WorkerId) -> dict[BlockKey, int]:
        """Every entry of one worker: router key -> tier mask (for checks and tools)."""
        ...

    async def stats(self) -> IndexStats:
        """Current sizes of the index."""
        ...

    async def close(self) -> None:
        """Stop background writers (queued writes are dropped)."""
        ...
