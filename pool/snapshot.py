"""CachedChains: the set of cached blocks that a worker's published KV events imply.

A worker folds every event batch it publishes into this tracker, so at any step boundary
it can hand a router the whole content of its prefix cache (``GET /v1/snapshot``) and the
router can resync that worker without replaying its event history.

The snapshot is a list of *runs*, each shaped like a ``BlockStored`` event: the hash of the
block before the run (``None`` at block 0), the hashes of the run's blocks, and their token
ids concatenated. Runs are the maximal unbranched paths of the prefix tree and come
parents first, so feeding them in order to an index as ``BlockStored`` events rebuilds it.
A block cached in several physical copies (two requests that computed the same prefix at
once) says so in its run's ``copies`` (one count per block, present only when some count
is above 1): an index that kept one copy would drop the block at the first copy's
``BlockRemoved`` while the worker still holds the other.

Seqs (and so a snapshot's ``next_seq``) count from 0 per publisher lifetime, so a
snapshot and ``/health`` also carry the worker's random lifetime id
(:func:`new_lifetime_id`): a router that sees it change knows the worker restarted, even
when the new lifetime's first batches never reached it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypedDict

from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, WireHash

__all__ = ["CachedChains", "ChainRun", "new_lifetime_id"]


def new_lifetime_id() -> str:
    """A random publisher lifetime id, chosen once per worker process: 32 lowercase hex digits."""
    return secrets.token_hex(16)


class _CopyCounts(TypedDict, total=False):
    copies: list[int]


class ChainRun(_CopyCounts):
    """One run of cached blocks in the JSON shape of ``/v1/snapshot``.

    ``copies``, when present, has one count (>= 1) per block of ``block_hashes``; absent,
    every block has one copy."""

    parent_block_hash: WireHash | None
    block_hashes: list[WireHash]
    token_ids: list[int]


@dataclass
class _Entry:
    parent: WireHash | None
    token_ids: list[int]
    # NOTE: number of physical copies the events announced and have not removed (>= 1).
    copies: int


class CachedChains:
    """Reference-counted cached blocks, built from ``BlockStored``/``BlockRemoved`` events.

    Args:
        block_size: Tokens per block of the worker.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # NOTE: keyed by wire hash; a hash is present iff at least one copy is cached.
        self._entries: dict[WireHash, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    @property
    def block_hashes(self) -> set[WireHash]:
        """The distinct cached block hashes."""
        return set(self._entries)

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        """Fold events into the tracker, in emission order."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._remove(block_hash)
            elif isinstance(event, AllBlocksCleared):
                self._entries.clear()

    def runs(self) -> list[ChainRun]:
        """The cached blocks as unbranched runs, parents before children.

        A run ends where its last block has no cached child or several; a run whose
        ``parent_block_hash`` is not itself cached starts at an evicted ancestor.
        """
        children: dict[WireHash | None, list[WireHash]] = {}
        for block_hash, entry in self._entries.items():
            children.setdefault(entry.parent, []).append(block_hash)
        for kids in children.values():
            kids.sort(key=_order)
        roots = sorted(
            (h for h, e in self._entries.items() if e.parent is None or e.parent not in self),
            key=_order,
        )
        runs: list[ChainRun] = []
        starts = list(reversed(roots))
        while starts:
            block_hash = starts.pop()
            run = ChainRun(
                parent_block_hash=self._entries[block_hash].parent, block_hashes=[], token_ids=[]
            )
            copies: list[int] = []
            while True:
                entry = self._entries[block_hash]
                run["block_hashes"].append(block_hash)
                run["token_ids"].extend(entry.token_ids)
                copies.append(entry.copies)
                kids = children.get(block_hash, [])
                if len(kids) != 1:
                    starts.extend(reversed(kids))
                    break
                block_hash = kids[0]
            if any(count > 1 for count in copies):
                run["copies"] = copies
            runs.append(run)
        return runs

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            entry = self._entries.get(block_hash)
            if entry is None:
                tokens = event.token_ids[i * size : (i + 1) * size]
                self._entries[block_hash] = _Entry(parent, list(tokens), 1)
            else:
                entry.copies += 1
            parent = block_hash

    def _remove(self, block_hash: WireHash) -> None:
        entry = self._entries.get(block_hash)
        if entry is None:
            return
        entry.copies -= 1
        if entry.copies == 0:
            del self._entries[block_hash]


def _order(block_hash: WireHash) -> tuple[int, int | bytes]:
    # A total order over int and bytes hashes, for a deterministic snapshot.
    return (0, block_hash) if isinstance(block_hash, int) else (1, block_hash)
