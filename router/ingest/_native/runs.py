"""The engine-hash bridge's bulk store: a run of new blocks in one call (C where built).

``store_run`` is the common case of a ``BlockStored``: every engine hash and router key
of the run is new to the worker (no copy held, no key held or with held children) and
distinct within the run. Each block then becomes a new entry with one copy on its tier;
its key word names the block before it (the run's ``parent`` for block 0) and is indexed
iff the run's first block is (prefix closure); each key becomes its predecessor's only
child. The C module ``router.ingest._native._runs`` does this without the interpreter, on the
bridge's maps as its compact ``WordMap`` tables (:data:`new_map`); :func:`store_run_py`,
on dicts, is the reference it is tested against and what runs where it was not built (or
``KVROUTE_PURE_PYTHON=1`` is set).

Invariant (both): ``True`` means every block was stored; ``False`` means the run is not
the common case and the three maps are exactly as they were (the caller then folds the
run block by block).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from itertools import pairwise
from typing import Any, Final

from events.hashing import BlockKey
from events.native import native_or
from events.schema import WireHash
from router.ingest._native.words import NONE, key_word

__all__ = [
    "NATIVE_RUNS",
    "dict_map",
    "map_of",
    "new_map",
    "remove_run",
    "remove_run_py",
    "store_run",
    "store_run_py",
]


def store_run_py(
    copies: MutableMapping[WireHash, int],
    keys: MutableMapping[BlockKey, int],
    children: MutableMapping[BlockKey, int],
    hashes: list[WireHash],
    run_keys: list[BlockKey],
    tag: BlockKey,
    parent: BlockKey | None,
    tier: int,
    indexed: bool,
) -> bool:
    """Store a run of new blocks (see the module docstring); the Python reference.

    Args:
        copies: The bridge's engine hash -> copy word map (:mod:`router.ingest._native.words`).
        keys: Its router key -> key word map.
        children: Its parent key -> child keys map.
        hashes: The run's engine hashes.
        run_keys: The run's router keys (as many as hashes, at least one).
        tag: The run's family tag.
        parent: The key the run chains from (``None``: block 0).
        tier: The tier's shift (``GPU_SHIFT`` or ``CPU_SHIFT``).
        indexed: Whether the run is indexed (its parent is, or it starts at block 0).

    Returns:
        Whether the run was stored (else nothing changed).
    """
    if not (
        copies.keys().isdisjoint(hashes)
        and keys.keys().isdisjoint(run_keys)
        and children.keys().isdisjoint(run_keys)
    ):
        return False
    one = 1 << tier
    base = key_word(tag, 0, indexed) | one  # each key's parent is OR-ed in below
    had_copies, had_keys = len(copies), len(keys)
    copies.update(zip(hashes, [one | key << 64 for key in run_keys], strict=True))
    parents = [NONE if parent is None else parent, *run_keys[:-1]]
    keys.update(zip(run_keys, [base | above << 128 for above in parents], strict=True))
    if len(copies) - had_copies != len(run_keys) or len(keys) - had_keys != len(run_keys):
        # A hash or key repeats within the run: undo (none was held before).
        for block_hash in hashes:
            copies.pop(block_hash, None)
        for key in run_keys:
            keys.pop(key, None)
        return False
    children.update(pairwise(run_keys))
    return True


def dict_map(lanes: int) -> MutableMapping[Any, int]:
    """A plain dict (``lanes`` unused): the bridge's maps where the C module was not built."""
    return {}


new_map: Final = native_or(dict_map, "router.ingest._native._runs", "WordMap")
"""``new_map(lanes)``: an empty map for the bridge, of ints (or bytes) to words of
``lanes`` 64-bit lanes: the C module's ``WordMap`` (entries inline in one table, see
``router/ingest/_native/_wordmap.h``) where built, else a dict."""


def map_of(lanes: int, entries: Mapping[Any, int]) -> MutableMapping[Any, int]:
    """A bridge map holding ``entries`` (taken over when the map type is dict)."""
    if isinstance(entries, dict) and new_map is dict_map:
        return entries
    found = new_map(lanes)
    found.update(entries)
    return found


def remove_run_py(
    copies: MutableMapping[WireHash, int],
    keys: MutableMapping[BlockKey, int],
    children: MutableMapping[BlockKey, int],
    hashes: list[WireHash],
    start: int,
    tier: int,
) -> tuple[int, list[int]]:
    """The reference of the C module's ``remove_run``: it takes none of the hashes, so the
    bridge's general path removes every one (see :data:`remove_run`)."""
    return start, []


remove_run: Final = native_or(remove_run_py, "router.ingest._native._runs", "remove_run")
"""``remove_run(copies, keys, children, hashes, start, tier) -> (stop, notes)``: the
removals ``hashes[start:stop]`` done in C on the bridge's WordMaps, stopping at the first
that is not simple. Simple: the hash's copy and its key's are the last ones, both on
``tier``; the key has no held children to unindex; its parent's link is a single child
(deleted if it is this key). ``notes`` is ``tag, key, mask`` for each indexed key whose
entry left, flat, in order; the bridge notes them and removes ``hashes[stop]`` itself."""


store_run: Final = native_or(store_run_py, "router.ingest._native._runs", "store_run")
"""The bulk store the bridge uses: the C module's where built, else :func:`store_run_py`."""
NATIVE_RUNS: Final = store_run is not store_run_py and new_map is not dict_map
"""Whether :data:`store_run`, :data:`remove_run` and :data:`new_map` are the C module's."""
