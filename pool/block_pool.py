"""The BlockPool: allocation, reference counting and prefix caching of KV cache blocks.

Semantics and method names follow vLLM V1's ``BlockPool`` so that the events it emits are
the ones a vLLM engine emits for the same requests:

* All blocks are created up front. Block 0 is the *null block*: it is never handed out,
  freed, hashed or counted, so a pool of ``N`` blocks has a capacity of ``N - 1``.
* Free blocks wait in a FIFO free queue (:class:`~pool.free_queue.FreeKVCacheBlockQueue`).
  A freed block that is cached keeps its hash and stays findable until
  :meth:`BlockPool.get_new_blocks` reuses it: eviction is lazy, and emits ``BlockRemoved``
  at that moment.
* The pool performs no I/O. Events accumulate in memory and the caller drains them with
  :meth:`BlockPool.take_events` once per engine step.

Events carry what vLLM 0.33's ``BlockPool`` sends for one full-attention group
(``docs/vllm-compat.md``): hashes in their 64-bit wire form, ``group_idx=0`` and, on
``BlockStored``, the request's LoRA int id and name as ``lora_id`` and ``lora_name``
(``None`` without LoRA) and ``extra_keys`` as a list with one entry per block: the
untagged form of what was hashed into it, ``None`` for a block without extra keys. The
KV cache manager adds the group's spec kind
(:meth:`pool.kv_cache_manager.KVCacheManager.take_events`), as vLLM's does.

Differences from vLLM, all deliberate: one KV cache group, so ``touch`` and
``free_blocks`` take flat block sequences; and ``free_blocks`` puts never-cached blocks at
the head of the free queue, so memory nothing can hit is reused before any cached prefix
is evicted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Final

from events.hashing import wire_hash
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pool.block import KVCacheBlock
from pool.cached_blocks import BlockHashToBlockMap
from pool.errors import NoFreeBlocksError
from pool.free_queue import FreeKVCacheBlockQueue
from pool.request import Request

__all__ = ["MEDIUM_GPU", "BlockPool"]

logger = logging.getLogger(__name__)

MEDIUM_GPU: Final = "GPU"
"""The ``medium`` of events about device-memory blocks (vLLM's default)."""

_GROUP_IDX: Final = 0
"""The KV cache group of every event: kvroute pools hold one full-attention group."""


class BlockPool:
    """A fixed set of KV cache blocks with reference counts and a prefix cache.

    Args:
        num_gpu_blocks: Number of physical blocks, the null block included (at least 1).
        enable_kv_cache_events: Record ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``
            events for :meth:`take_events`.
        medium: The ``medium`` field of the events.

    Attributes:
        num_gpu_blocks: Number of physical blocks, the null block included.
        blocks: Every block, indexed by block id.
        free_block_queue: The free blocks, next to be reused first.
        cached_block_hash_to_block: Hash digest → the block(s) caching it.
        null_block: Block 0, a placeholder that is never allocated.
        enable_kv_cache_events: Whether events are recorded.
        medium: The ``medium`` field of the events.
    """

    __slots__ = (
        "blocks",
        "cached_block_hash_to_block",
        "enable_kv_cache_events",
        "free_block_queue",
        "kv_event_queue",
        "medium",
        "null_block",
        "num_gpu_blocks",
    )

    def __init__(
        self,
        num_gpu_blocks: int,
        *,
        enable_kv_cache_events: bool = False,
        medium: str = MEDIUM_GPU,
    ) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(
                f"num_gpu_blocks must be at least 1 (the null block), got {num_gpu_blocks}"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_gpu_blocks)]
        # NOTE: free + referenced == num_gpu_blocks - 1 (the null block is neither).
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.medium = medium
        self.kv_event_queue: list[KVCacheEvent] = []

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """A block caching ``block_hash`` (the earliest cached among copies), or ``None``."""
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Cache the blocks of ``request`` that just became full.

        Blocks ``num_cached_blocks .. num_full_blocks - 1`` of ``blocks`` get the matching
        hashes of ``request.block_hashes`` and become findable; one ``BlockStored`` covers
        them all. Nothing happens when no block became full.

        Args:
            request: The request that owns ``blocks``.
            blocks: The request's blocks, in token order.
            num_cached_blocks: How many leading blocks are already cached.
            num_full_blocks: How many leading blocks are full now.
            block_size: Tokens per block.

        Raises:
            ValueError: ``request`` has fewer block hashes than ``num_full_blocks``.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id!r} has {len(hashes)} block hashes, "
                f"cannot cache {num_full_blocks} full blocks"
            )
        new_hashes = hashes[num_cached_blocks:num_full_blocks]
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        for block, block_hash in zip(new_blocks, new_hashes, strict=True):
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block.block_hash = block_hash
        self.cached_block_hash_to_block.insert_blocks(new_blocks)
        if not self.enable_kv_cache_events:
            return
        parent = wire_hash(hashes[num_cached_blocks - 1]) if num_cached_blocks else None
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=[wire_hash(block_hash) for block_hash in new_hashes],
                parent_block_hash=parent,
                token_ids=request.all_token_ids[
                    num_cached_blocks * block_size : num_full_blocks * block_size
                ],
                block_size=block_size,
                lora_id=request.lora_id,
                medium=self.medium,
                lora_name=request.lora_name,
                extra_keys=request.event_extra_keys(num_cached_blocks, num_full_blocks),
                group_idx=_GROUP_IDX,
            )
        )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ref count 1.

        A taken block that is still cached is evicted first (``BlockRemoved``).

        Raises:
            NoFreeBlocksError: Fewer than ``num_blocks`` blocks are free (a ``ValueError``).
        """
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise NoFreeBlocksError(
                f"cannot get {num_blocks} free blocks: {queue.num_free_blocks} are free"
            )
        blocks = queue.popleft_n(num_blocks)
        cached = []
        for block in blocks:
            if block.block_hash is not None:
                cached.append(block)
            block.ref_cnt = 1
        if cached:
            self._evict_cached_blocks(cached)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a hit that was free leaves the free queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks that reach zero become free.

        Freed blocks keep the given order: cached ones join the tail of the free queue
        (evicted last, so their prefix stays findable longest), never-cached ones join the
        head (reused first, since nothing can hit them). The null block is skipped.

        Args:
            ordered_blocks: The blocks in eviction-priority order; a request frees its
                blocks last-first, so its tail blocks are evicted before its prefix.
        """
        cached: list[KVCacheBlock] = []
        uncached: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                (uncached if block.block_hash is None else cached).append(block)
        queue = self.free_block_queue
        queue.append_n(cached)
        queue.prepend_n(uncached)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove the given blocks from the prefix cache (``BlockRemoved`` for each cached).

        The blocks keep their ref counts and queue positions; blocks that are not cached
        are ignored.
        """
        blocks = self.blocks
        unique = [blocks[block_id] for block_id in dict.fromkeys(block_ids)]
        self._evict_cached_blocks([block for block in unique if block.block_hash is not None])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (``AllBlocksCleared``), only when every block is free.

        Returns:
            True on success; False (nothing changes) while any block is referenced.
        """
        num_used = self.num_gpu_blocks - 1 - self.free_block_queue.num_free_blocks
        if num_used:
            logger.warning(
                "prefix cache not reset: %d blocks are still in use (free them first)", num_used
            )
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        """Number of blocks that :meth:`get_new_blocks` can hand out now."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (null block excluded) that are referenced."""
        capacity = self.num_gpu_blocks - 1
        if not capacity:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / capacity

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, in order; empty when events are off."""
        events = self.kv_event_queue
        self.kv_event_queue = []
        return events

    def _evict_cached_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Evict cached blocks (each has a hash): one ``BlockRemoved`` per block, in order."""
        self.cached_block_hash_to_block.remove_blocks(blocks)
        if self.enable_kv_cache_events:
            medium = self.medium
            self.kv_event_queue.extend(
                [
                    BlockRemoved(
                        # Every block given here is cached, so its hash is set.
                        block_hashes=[wire_hash(block.block_hash)],  # type: ignore[arg-type]
                        medium=medium,
                        group_idx=_GROUP_IDX,
                    )
                    for block in blocks
                ]
            )
        for block in blocks:
            block.block_hash = None
