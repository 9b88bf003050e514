"""Entry changes of one worker, grouped by prefix family: what an index write applies.

The engine-hash bridge folds events into a :class:`Changes`; an index writes it; group
commit merges the changes of later batches into pending ones. Per family tag, each
touched router key maps to its :data:`Transition`: the tier bits the worker held for the
key before the first folded event (``old``) and after the last (``new``), as the small
int ``old << 2 | new``. Small ints are shared objects, so storing one allocates nothing
(and is invisible to the garbage collector), a run of new keys is stored with one
C-level ``dict.update``, and a writer finds a family's kinds of change with one
``set()`` of its values.

Invariants: a key appears under exactly one family (its tag is a function of the key:
the router key of block 0 of its chain); no stored transition is a no-op
(``old_mask != new_mask``): one that becomes a no-op is dropped at once, so a writer never
filters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Final

from events.hashing import BlockKey

__all__ = ["CPU_MASK", "GPU_MASK", "Changes", "Transition", "masks_of", "transition"]

GPU_MASK: Final = 1
"""Presence bit of a block held on the GPU tier (medium ``"GPU"`` or unspecified)."""
CPU_MASK: Final = 2
"""Presence bit of a block held on a slower tier (``"CPU"``, ``"STORAGE"``, ...)."""

Transition = int
"""``old_mask << 2 | new_mask`` of one entry; masks are 0..3 (GPU and CPU bits)."""


def transition(old: int, new: int) -> Transition:
    """The transition from mask ``old`` to mask ``new``."""
    return old << 2 | new


def masks_of(change: Transition) -> tuple[int, int]:
    """``(old_mask, new_mask)`` of a transition."""
    return change >> 2, change & 3


class Changes:
    """Entry changes by family tag, then router key (see the module docstring)."""

    __slots__ = ("families",)

    def __init__(self) -> None:
        self.families: dict[BlockKey, dict[BlockKey, Transition]] = {}

    def __bool__(self) -> bool:
        return bool(self.families)

    def __len__(self) -> int:
        return sum(map(len, self.families.values()))

    def items(self) -> Iterator[tuple[BlockKey, BlockKey, Transition]]:
        """Every ``(tag, key, transition)``."""
        for tag, family in self.families.items():
            for key, change in family.items():
                yield tag, key, change

    def masks(self) -> dict[BlockKey, tuple[int, int]]:
        """Router key -> ``(old_mask, new_mask)`` over all families (for tests and tools)."""
        return {key: masks_of(change) for _, key, change in self.items()}

    def note(self, tag: BlockKey, key: BlockKey, old: int, new: int) -> None:
        """Record that the worker's entry for ``key`` went from ``old`` to ``new``."""
        family = self.families.get(tag)
        if family is None:
            if old != new:
                self.families[tag] = {key: old << 2 | new}
            return
        previous = family.get(key)
        first = old if previous is None else previous >> 2
        if first == new:
            if previous is not None:
                del family[key]
                if not family:
                    del self.families[tag]
        else:
            family[key] = first << 2 | new

    def add_new(self, tag: BlockKey, keys: Iterable[BlockKey], mask: int) -> None:
        """Record entries that appear with ``mask`` (in bulk where no key was noted yet)."""
        family = self.families.get(tag)
        if family is None:
            self.families[tag] = dict.fromkeys(keys, transition(0, mask))
        elif family.keys().isdisjoint(keys):
            family.update(dict.fromkeys(keys, transition(0, mask)))
        else:
            for key in keys:
                self.note(tag, key, 0, mask)

    def merge(self, later: Changes) -> None:
        """Fold ``later`` (folded after these) in: per key the first old, the last new mask.

        ``later`` must not be used afterwards (its family dicts may be taken over).
        """
        for tag, theirs in later.families.items():
            mine = self.families.get(tag)
            if mine is None:
                self.families[tag] = theirs
                continue
            if mine.keys().isdisjoint(theirs):  # the common case: other blocks
                mine.update(theirs)
                continue
            firsts = {key: mine[key] >> 2 for key in mine.keys() & theirs.keys()}
            mine.update(theirs)
            for key, first in firsts.items():
                new = theirs[key] & 3
                if first == new:
                    del mine[key]
                else:
                    mine[key] = first << 2 | new
            if not mine:
                del self.families[tag]
