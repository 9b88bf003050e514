"""Entry changes of one worker, grouped by prefix family: what an index write applies.

The engine-hash bridge folds events into a :class:`Changes`; an index writes it; with
group commit, later batches fold into the ones still pending. Per family tag, each
touched router key maps to its :data:`Transition`: the tier bits the worker held for the
key before the first folded event (``old``) and after the last (``new``), as the small
int ``old << 2 | new``.

A family holds its changes in one of two forms. *Noted*: a dict router key -> transition,
which any change can update. *Added*: the runs of keys that appeared in bulk
(:meth:`Changes.add_new`, the ingest's common case: newly cached blocks), kept per tier as
the very lists they came in: appending a run and writing the family cost no per-key dict
work. The first :meth:`Changes.note` of an added family turns it
into a noted one.

Invariants: a key appears under exactly one family (its tag is a function of the key:
the router key of block 0 of its chain), and a family is in exactly one form. No noted
transition is a no-op (``old_mask != new_mask``): one that becomes a no-op is dropped at
once, so a writer never filters. The runs of an added family are pairwise disjoint and
none of their keys was ever noted: each is an entry that appeared and is still held.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final

from events.hashing import BlockKey

__all__ = ["CPU_MASK", "GPU_MASK", "Changes", "KeyLists", "Transition", "masks_of", "transition"]

GPU_MASK: Final = 1
"""Presence bit of a block held on the GPU tier (medium ``"GPU"`` or unspecified)."""
CPU_MASK: Final = 2
"""Presence bit of a block held on a slower tier (``"CPU"``, ``"STORAGE"``, ...)."""

Transition = int
"""``old_mask << 2 | new_mask`` of one entry; masks are 0..3 (GPU and CPU bits)."""

KeyLists = tuple[list[BlockKey], list[BlockKey], list[BlockKey], list[BlockKey]]
"""A family's keys by what an index does with them: GPU gained, GPU lost, CPU gained,
CPU lost (a key whose entry moves between tiers is in two lists)."""

_Runs = tuple[list[Sequence[BlockKey]], list[Sequence[BlockKey]]]
"""An added family: the runs of keys whose entries appeared on the GPU tier, and on the CPU
tier (indexed by ``mask >> 1``: no allocation per run)."""


def transition(old: int, new: int) -> Transition:
    """The transition from mask ``old`` to mask ``new``."""
    return old << 2 | new


def masks_of(change: Transition) -> tuple[int, int]:
    """``(old_mask, new_mask)`` of a transition."""
    return change >> 2, change & 3


def _lists_of(change: Transition) -> tuple[int, ...]:
    """Which of the four :data:`KeyLists` an entry with this transition joins."""
    old, new = masks_of(change)
    gained, lost = new & ~old, old & ~new
    bits = (gained & GPU_MASK, lost & GPU_MASK, gained & CPU_MASK, lost & CPU_MASK)
    return tuple(i for i, bit in enumerate(bits) if bit)


_LISTS: Final = tuple(_lists_of(change) for change in range(16))


class Changes:
    """Entry changes by family tag, then router key (see the module docstring)."""

    __slots__ = ("_added", "_noted")

    def __init__(self) -> None:
        self._noted: dict[BlockKey, dict[BlockKey, Transition]] = {}
        self._added: dict[BlockKey, _Runs] = {}

    def __bool__(self) -> bool:
        return bool(self._noted) or bool(self._added)

    def __len__(self) -> int:
        added = sum(len(keys) for tiers in self._added.values() for runs in tiers for keys in runs)
        return added + sum(map(len, self._noted.values()))

    @property
    def families(self) -> dict[BlockKey, dict[BlockKey, Transition]]:
        """Family tag -> router key -> transition, every family as a new dict (for tests
        and tools; a writer takes :meth:`key_lists`)."""
        out = {tag: dict(family) for tag, family in self._noted.items()}
        out.update((tag, _as_dict(tiers)) for tag, tiers in self._added.items())
        return out

    def items(self) -> Iterator[tuple[BlockKey, BlockKey, Transition]]:
        """Every ``(tag, key, transition)``."""
        for tag, family in self._noted.items():
            for key, change in family.items():
                yield tag, key, change
        for tag, tiers in self._added.items():
            for mask, runs in zip((GPU_MASK, CPU_MASK), tiers, strict=True):
                for keys in runs:
                    for key in keys:
                        yield tag, key, mask  # transition(0, mask) == mask

    def masks(self) -> dict[BlockKey, tuple[int, int]]:
        """Router key -> ``(old_mask, new_mask)`` over all families (for tests and tools)."""
        return {key: masks_of(change) for _, key, change in self.items()}

    def key_lists(self) -> Iterator[tuple[BlockKey, KeyLists]]:
        """Per family tag, its keys by what an index does with them (:data:`KeyLists`)."""
        for tag, family in self._noted.items():
            lists: KeyLists = ([], [], [], [])
            kinds = set(family.values())
            if len(kinds) == 1:  # the common case: one kind of change (say, all removed)
                for i in _LISTS[kinds.pop()]:
                    lists[i].extend(family)
            else:
                for key, change in family.items():
                    for i in _LISTS[change]:
                        lists[i].append(key)
            yield tag, lists
        for tag, (gpu, cpu) in self._added.items():
            lists = ([], [], [], [])
            for keys in gpu:
                lists[0].extend(keys)
            for keys in cpu:
                lists[2].extend(keys)
            yield tag, lists

    def note(self, tag: BlockKey, key: BlockKey, old: int, new: int) -> None:
        """Record that the worker's entry for ``key`` went from ``old`` to ``new``."""
        family = self._noted.get(tag)
        if family is None:
            tiers = self._added.pop(tag, None)
            if tiers is None:
                if old != new:
                    self._noted[tag] = {key: old << 2 | new}
                return
            family = self._noted[tag] = _as_dict(tiers)
        previous = family.get(key)
        first = old if previous is None else previous >> 2
        if first == new:
            if previous is not None:
                del family[key]
                if not family:
                    del self._noted[tag]
        else:
            family[key] = first << 2 | new

    def add_new(self, tag: BlockKey, keys: Sequence[BlockKey], mask: int) -> None:
        """Record entries that appear with ``mask`` (``mask`` non-zero).

        ``keys`` must be entries the worker does not hold now (one noted as removed is
        fine); the sequence is kept, not copied: the caller must not change it after.
        """
        if not keys:
            return
        family = self._noted.get(tag)
        if family is None and mask in (GPU_MASK, CPU_MASK):
            tiers = self._added.get(tag)
            if tiers is None:
                tiers = self._added[tag] = ([], [])
            tiers[mask >> 1].append(keys)  # disjoint: those keys are held, these are not
        elif family is not None and family.keys().isdisjoint(keys):
            family.update(dict.fromkeys(keys, transition(0, mask)))
        else:
            for key in keys:
                self.note(tag, key, 0, mask)


def _as_dict(tiers: _Runs) -> dict[BlockKey, Transition]:
    """An added family as a noted one."""
    family: dict[BlockKey, Transition] = {}
    for mask, runs in zip((GPU_MASK, CPU_MASK), tiers, strict=True):
        for keys in runs:
            family.update(dict.fromkeys(keys, transition(0, mask)))
    return family
