"""Engine-hash bridge: folds one worker's KV events into changes of router-key index entries.

The router never trusts an engine's hash algorithm: for each ``BlockStored`` it computes
its own chained keys from the token ids (:func:`events.hashing.router_block_keys`),
chaining from the router key of the event's parent, found in this per-worker map
engine hash -> router key. ``BlockRemoved`` goes through the same map. Every physical
copy is reference-counted per (engine hash, tier), and every router key per tier, so an
entry leaves the index only when its last copy on that tier is removed. The state is held
as packed ints (:mod:`router.ingest._native.words`: their layout and invariants).

The bridge is I/O-free: it produces :class:`~router.index.changes.Changes` (the
transition of each touched router key's presence mask) that an index store writes, and
:func:`fold_batch` drives it over a whole batch (for
:class:`~router.ingest.bridged_index.BridgedIndex`, whatever the store).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field

from events.hashing import BlockKey, RouterKeyer, router_block_keys
from events.identity import WorkerId
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, WireHash
from router.errors import OrphanParentError
from router.index.changes import CPU_MASK, GPU_MASK, Changes
from router.ingest._native.runs import map_of, new_map, remove_run, store_run
from router.ingest._native.words import (
    COPY_LANES,
    COUNT,
    COUNTS,
    CPU_SHIFT,
    GPU_SHIFT,
    INDEXED,
    KEY_LANES,
    NONE,
    BridgeState,
    checked_links,
    key_of,
    key_word,
    mask_of,
    pack_kids,
    parent_of,
    tag_of,
    unpack_kids,
)

__all__ = [
    "BridgeCounters",
    "WorkerBridge",
    "cache_salt_of",
    "fold_batch",
    "tier_mask",
]


def tier_mask(medium: str | None) -> int:
    """The presence bit of a medium: GPU for ``"GPU"`` or ``None``, else CPU."""
    return GPU_MASK if medium is None or medium.upper() == "GPU" else CPU_MASK


def cache_salt_of(event: BlockStored) -> str | None:
    """The cache salt a chain-starting ``BlockStored`` carries in block 0's extra keys.

    vLLM publishes block 0's extra keys untagged, in the order it hashes them: the LoRA
    name (on a LoRA request), multimodal ``(id, offset)`` pairs as arrays, the cache salt,
    a prompt-embeddings digest as bytes. So the salt is the first string after the
    leading LoRA name, even when it equals that name.
    """
    if event.parent_block_hash is not None or not event.extra_keys:
        return None
    first = event.extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return None
    lora = event.lora_name
    start = 1 if lora is not None and first and first[0] == lora else 0
    return next((k for k in first[start:] if isinstance(k, str)), None)


@dataclass(slots=True)
class BridgeCounters:
    """What the bridge skipped, by reason (exported as Prometheus counters by ingest)."""

    malformed: int = 0
    unknown_removals: int = 0
    orphans: int = 0
    detached: int = 0
    ignored_groups: int = 0
    block_size_mismatch: int = 0


class _Orphan(Exception):
    def __init__(self, parent: WireHash) -> None:
        super().__init__(parent)
        self.parent = parent


@dataclass(slots=True)
class WorkerBridge:
    """Per-worker map engine hash -> router key with reference-counted copies.

    Args:
        keyer: The cluster's router key function (its seed).
        tolerate_orphans: Store a ``BlockStored`` with an unknown parent as detached
            (counted, never indexed) instead of raising; set once a worker's history is
            known to be lost (resync without snapshot) or while loading a snapshot.
        block_size: The worker's registered block size: a ``BlockStored`` of another
            size is counted and skipped whole (its keys would not match any request's).
            0: any size.
        mismatched_block_size: The block size of the last ``BlockStored`` skipped for
            that (0: none yet).
    """

    keyer: RouterKeyer
    tolerate_orphans: bool = False
    counters: BridgeCounters = field(default_factory=BridgeCounters)
    block_size: int = 0
    mismatched_block_size: int = 0
    _copies: MutableMapping[WireHash, int] = field(default_factory=lambda: new_map(COPY_LANES))
    _keys: MutableMapping[BlockKey, int] = field(default_factory=lambda: new_map(KEY_LANES))
    # NOTE: parent key -> its held child keys (whether or not the parent is held): one
    # key, or several packed in one int when the chain branches (see words.pack_kids).
    _children: MutableMapping[BlockKey, int] = field(default_factory=lambda: new_map(1))

    def state(self) -> BridgeState:
        """A copy of the maps (see :meth:`from_state`)."""
        return BridgeState(dict(self._copies), dict(self._keys), self.tolerate_orphans)

    @classmethod
    def from_state(cls, keyer: RouterKeyer, state: BridgeState) -> WorkerBridge:
        """A bridge holding ``state`` (from :meth:`state`, possibly of another router);
        it takes the state's maps over (the caller must not use them afterwards).

        Raises:
            ValueError: ``state`` breaks an invariant of the words
                (:func:`router.index.words.checked_links`).
        """
        links = checked_links(state)
        children: dict[BlockKey, int] = dict(links)
        copies, keys = map_of(COPY_LANES, state.copies), map_of(KEY_LANES, state.keys)
        bridge = cls(keyer, state.tolerate_orphans, _copies=copies, _keys=keys)
        if len(children) == len(links):  # no branches: one child per parent
            bridge._children = map_of(1, children)
        else:
            for parent, key in links:
                bridge._link(parent, key)
        return bridge

    def entries(self) -> dict[BlockKey, tuple[BlockKey, int]]:
        """Every indexed router key with its family tag and tier mask."""
        return {
            key: (tag_of(state), mask_of(state))
            for key, state in self._keys.items()
            if state & INDEXED
        }

    def reset(self) -> Changes:
        """Forget everything; returns the removal of every indexed entry."""
        changes = Changes()
        for key, state in self._keys.items():
            if state & INDEXED:
                changes.note(tag_of(state), key, mask_of(state), 0)
        self._copies.clear()
        self._keys.clear()
        self._children.clear()
        return changes

    def store(self, event: BlockStored, changes: Changes) -> None:
        """Fold one ``BlockStored`` into ``changes``.

        A malformed event (token count not ``len(block_hashes) * block_size``, token ids
        outside uint32, a bad block size) is counted and skipped whole, and so is one
        whose block size is not the worker's (checked first: it never counts as an
        orphan, so a worker whose registration is wrong causes no replays).

        Raises:
            _Orphan: The parent hash is unknown; nothing of the event was folded.
        """
        if self.block_size and event.block_size != self.block_size:
            self.counters.block_size_mismatch += 1
            self.mismatched_block_size = event.block_size
            return
        if not _is_well_formed(event):
            self.counters.malformed += 1
            return
        if event.group_idx not in (None, 0):
            # Only the first KV cache group describes the full prefix; others (sliding
            # window, hybrid models) would claim prefixes the worker cannot serve.
            self.counters.ignored_groups += 1
            return
        parent: BlockKey | None = None
        if event.parent_block_hash is None:
            parent_key: int = self.keyer.root(event.lora_name, cache_salt_of(event))
            tag: BlockKey | None = None
            indexed = True
        else:
            parent_copies = self._copies.get(event.parent_block_hash)
            if parent_copies is None and not self.tolerate_orphans:
                self.counters.orphans += 1
                raise _Orphan(event.parent_block_hash)
            if parent_copies is None or key_of(parent_copies) == NONE:
                self.counters.detached += 1
                self._store_detached(event, changes)
                return
            parent = BlockKey(key_of(parent_copies))
            parent_key = parent
            parent_word = self._keys[parent]
            tag, indexed = tag_of(parent_word), bool(parent_word & INDEXED)
        try:
            keys = router_block_keys(event.token_ids, event.block_size, parent_key)
        except OverflowError:  # a token id outside uint32
            self.counters.malformed += 1
            return
        if tag is None:
            tag = keys[0]
        tier = _tier(event.medium)
        hashes = event.block_hashes
        maps = (self._copies, self._keys, self._children)
        if store_run(*maps, hashes, keys, tag, parent, tier, indexed):
            if parent is not None:
                self._link(parent, keys[0])
            if indexed:
                changes.add_new(tag, keys, GPU_MASK if tier == GPU_SHIFT else CPU_MASK)
            return
        for block_hash, key in zip(hashes, keys, strict=True):
            copies = self._copies.get(block_hash)
            if copies is None:
                self._copies[block_hash] = key << 64
            elif key_of(copies) == NONE:
                # Now reachable from block 0: its earlier copies are indexed too.
                self._copies[block_hash] = key << 64
                for t in (GPU_SHIFT, CPU_SHIFT):
                    for _ in range((copies >> t) & COUNT):
                        self._add(block_hash, t, +1, tag, parent, changes)
            # NOTE: a hash re-stored with other tokens keeps its first key: the index
            # already holds that one and children chain from it.
            self._add(block_hash, tier, +1, tag, parent, changes)
            parent = key

    def remove(self, event: BlockRemoved, changes: Changes) -> None:
        """Fold one ``BlockRemoved`` into ``changes``; unknown copies are counted."""
        if event.group_idx not in (None, 0):
            self.counters.ignored_groups += 1
            return
        tier = _tier(event.medium)
        hashes, maps = event.block_hashes, (self._copies, self._keys, self._children)
        start = 0
        while start < len(hashes):
            # The simple removals in C where built (see runs.remove_run), the next here.
            start, notes = remove_run(*maps, hashes, start, tier)
            for i in range(0, len(notes), 3):
                changes.note(BlockKey(notes[i]), BlockKey(notes[i + 1]), notes[i + 2], 0)
            if start < len(hashes):
                self._remove_one(hashes[start], tier, changes)
                start += 1

    def _remove_one(self, block_hash: WireHash, tier: int, changes: Changes) -> None:
        one = 1 << tier
        all_copies, keys = self._copies, self._keys
        copies = all_copies.get(block_hash)
        if copies is None or not (copies >> tier) & COUNT:
            self.counters.unknown_removals += 1
            return
        key = BlockKey(key_of(copies))
        if key == NONE:
            all_copies[block_hash] = copies - one
        else:
            state = keys[key]
            if copies & COUNTS == one and state & COUNTS == one:
                # The common case: the key's last copy goes, and the hash's.
                del all_copies[block_hash], keys[key]
                self._drop(key, state, changes)
                return
            self._add(block_hash, tier, -1, tag_of(state), parent_of(state), changes)
        if not all_copies[block_hash] & COUNTS:
            del all_copies[block_hash]

    def _store_detached(self, event: BlockStored, changes: Changes) -> None:
        tier = _tier(event.medium)
        for block_hash in event.block_hashes:
            copies = self._copies.get(block_hash, NONE << 64)
            if key_of(copies) == NONE:
                self._copies[block_hash] = copies + (1 << tier)
            else:  # another copy of a hash already held with a key: count it there
                state = self._keys[BlockKey(key_of(copies))]
                self._add(block_hash, tier, +1, tag_of(state), parent_of(state), changes)

    def _add(
        self,
        block_hash: WireHash,
        tier: int,
        delta: int,
        tag: BlockKey,
        parent: BlockKey | None,
        changes: Changes,
    ) -> None:
        copies = self._copies[block_hash]
        key = BlockKey(key_of(copies))
        keys = self._keys
        state = keys.get(key)
        if state is None:
            above = None if parent is None else keys.get(parent)
            indexed = parent is None or (above is not None and bool(above & INDEXED))
            state = key_word(tag, parent, indexed)
            if parent is not None:
                self._link(parent, key)
        before = mask_of(state)
        self._copies[block_hash] = copies + (delta << tier)
        after = mask_of(state + (delta << tier))
        if after == 0:  # its last copy went (before != 0: delta is -1)
            del keys[key]
            self._drop(key, state, changes)
            return
        keys[key] = state = state + (delta << tier)
        if after == before:
            return
        indexed = bool(state & INDEXED)
        if indexed:
            changes.note(tag_of(state), key, before, after)
        if before == 0 and indexed and key in self._children:
            self._cascade(key, True, changes)

    def _drop(self, key: BlockKey, state: int, changes: Changes) -> None:
        """Finish removing a key that lost its last copy (``state``: its word before, with
        those copies still counted; the caller took it out of the maps): its entry leaves
        the index, its held descendants are unindexed, its parent forgets it."""
        if state & INDEXED:
            changes.note(tag_of(state), key, mask_of(state), 0)
        above = parent_of(state)
        if above is not None:
            self._unlink(above, key)
        if state & INDEXED and key in self._children:
            self._cascade(key, False, changes)

    def _link(self, parent: BlockKey, key: BlockKey) -> None:
        kids = self._children.get(parent)
        if kids is None:
            self._children[parent] = key
            return
        held = unpack_kids(kids)
        if key not in held:
            self._children[parent] = pack_kids((*held, key))

    def _unlink(self, parent: BlockKey, key: BlockKey) -> None:
        kids = self._children.get(parent)
        if kids is None:
            return
        if kids == key:  # its only child (see words.pack_kids)
            del self._children[parent]
            return
        rest = tuple(k for k in unpack_kids(kids) if k != key)
        if rest:
            self._children[parent] = pack_kids(rest)
        else:
            del self._children[parent]

    def _cascade(self, root: BlockKey, indexed: bool, changes: Changes) -> None:
        """(Un)index the held descendants of ``root`` (iteratively: chains are long)."""
        stack = [root]
        children, keys = self._children, self._keys
        while stack:
            kids = children.get(stack.pop())
            for child in () if kids is None else unpack_kids(kids):
                state = keys[child]
                if bool(state & INDEXED) == indexed:
                    continue
                keys[child] = state ^ INDEXED
                mask = mask_of(state)
                changes.note(tag_of(state), child, 0 if indexed else mask, mask if indexed else 0)
                stack.append(child)


def _tier(medium: str | None) -> int:
    return GPU_SHIFT if tier_mask(medium) == GPU_MASK else CPU_SHIFT


def _is_well_formed(event: BlockStored) -> bool:
    # Token ids outside uint32 are caught where the keys are computed (OverflowError).
    size = event.block_size
    return (
        size > 0
        and bool(event.block_hashes)
        and (len(event.token_ids) == size * len(event.block_hashes))
    )


async def fold_batch(
    worker_id: WorkerId,
    bridge: WorkerBridge,
    batch: KVEventBatch,
    write: Callable[[Changes], Awaitable[None]],
    clear: Callable[[], Awaitable[None]],
    into: Callable[[], Changes] = Changes,
) -> None:
    """Apply a batch through ``bridge``: the body of ``BridgedIndex.apply``.

    Changes are written in segments: everything up to an ``AllBlocksCleared`` is written,
    then ``clear`` empties the worker (also entries the bridge does not know, e.g. after
    a router restart), then the rest follows.

    Args:
        worker_id: The worker the batch came from.
        bridge: That worker's bridge.
        batch: The decoded batch.
        write: Writes one segment's changes to the index (called when they are not empty).
        clear: Drops every entry of the worker from the index and resets the bridge.
        into: Gives the changes each segment is folded into: new ones by default; with
            group commit the worker's queued ones, which ``write`` then only sends on.

    Raises:
        OrphanParentError: A ``BlockStored`` has an unknown parent; the events before it
            were applied and written.
    """
    changes = into()
    for position, event in enumerate(batch.events):
        if isinstance(event, BlockStored):
            try:
                bridge.store(event, changes)
            except _Orphan as orphan:
                await _flush(write, changes)
                raise OrphanParentError(worker_id, orphan.parent, position) from None
        elif isinstance(event, BlockRemoved):
            bridge.remove(event, changes)
        elif isinstance(event, AllBlocksCleared):
            await _flush(write, changes)
            await clear()
            changes = into()
    await _flush(write, changes)


async def _flush(write: Callable[[Changes], Awaitable[None]], changes: Changes) -> None:
    if changes:
        await write(changes)
