"""Request keys per block size: a prompt keyed once for each block size among its candidates.

A prompt's router keys depend on the block size, and workers of one cluster may run
different ones (or be registered with a wrong one). The candidates are grouped by their
registered block size and the prompt keyed once per group; each group's cached prefixes
are looked up with its own keys (one index round trip per group). Prefix lengths are
expressed in blocks of the smallest size among the candidates, the unit the policy
counts in: a match in larger blocks is rescaled into it exactly (when the sizes divide)
or rounded down, never up. So one worker registered with an absurd block size changes
nothing for the others: it only matches nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from router.index.base import PrefixMatch
from router.workers.registry import WorkerRecord

__all__ = ["BlockSizeGroups", "RequestKeys", "group_by_block_size", "key_request", "rescale"]


@dataclass(frozen=True, slots=True)
class BlockSizeGroups:
    """Candidates grouped by registered block size (the same for every request to them).

    Attributes:
        groups: Block size -> the candidates of that size, in the order given.
        sizes: Candidate -> its block size.
    """

    groups: Mapping[int, Sequence[WorkerId]]
    sizes: Mapping[WorkerId, int]


def group_by_block_size(records: Sequence[WorkerRecord]) -> BlockSizeGroups:
    """Group ``records`` (at least one) by block size."""
    groups: dict[int, list[WorkerId]] = {}
    sizes: dict[WorkerId, int] = {}
    for record in records:
        wid = record.worker_id
        groups.setdefault(record.block_size, []).append(wid)
        sizes[wid] = record.block_size
    return BlockSizeGroups(groups, sizes)


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """One prompt's router keys for each block size among its candidates.

    Attributes:
        base: The smallest of those block sizes: prefix lengths are counted in its blocks.
        keys: Block size -> the prompt's keys of its full blocks of that size, from block 0.
        groups: Block size -> the candidates of that size, in the order given.
        sizes: Candidate -> its block size.
    """

    base: int
    keys: Mapping[int, Sequence[BlockKey]]
    groups: Mapping[int, Sequence[WorkerId]]
    sizes: Mapping[WorkerId, int]

    @property
    def base_keys(self) -> Sequence[BlockKey]:
        """The keys in blocks of :attr:`base` (what the policy sees)."""
        return self.keys[self.base]

    def of(self, worker_id: WorkerId) -> Sequence[BlockKey]:
        """The keys in blocks of ``worker_id``'s size (the base size for a non-candidate)."""
        return self.keys[self.sizes.get(worker_id, self.base)]


def key_request(
    keyer: RouterKeyer,
    token_ids: Sequence[int],
    candidates: BlockSizeGroups,
    cache_salt: str | None = None,
) -> RequestKeys:
    """Key the prompt once per block size among ``candidates`` (see
    :func:`group_by_block_size`)."""
    groups = candidates.groups
    keys = {size: keyer.keys(token_ids, size, cache_salt=cache_salt) for size in groups}
    return RequestKeys(min(groups), keys, groups, candidates.sizes)


def rescale(match: PrefixMatch, size: int, base: int) -> PrefixMatch:
    """A match in blocks of ``size`` tokens expressed in whole blocks of ``base`` tokens."""
    return PrefixMatch(
        match.num_blocks * size // base,
        match.num_gpu_blocks * size // base,
        match.num_cpu_blocks * size // base,
    )
