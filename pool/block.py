"""The metadata of one physical KV cache block: id, reference count, hash, free-list links."""

from __future__ import annotations

__all__ = ["KVCacheBlock"]


class KVCacheBlock:
    """One physical block of the paged KV cache, as the :class:`~pool.block_pool.BlockPool` sees it.

    The block holds no tensor data: the block id indexes the worker's KV tensor. The two
    link fields make the block a node of the intrusive free list
    (:class:`~pool.free_queue.FreeKVCacheBlockQueue`), so moving a block in or out of the
    free queue allocates nothing.

    Attributes:
        block_id: Index of the block in the pool, ``0 .. num_gpu_blocks - 1``.
        ref_cnt: Number of running requests that hold the block.
        block_hash: The block's hash digest while it is cached (findable by prefix), else
            ``None``.
        prev_free_block: Previous node in the free queue, ``None`` when not queued.
        next_free_block: Next node in the free queue, ``None`` when not queued.
        is_null: True only for the pool's null block (block 0).
    """

    __slots__ = (
        "block_hash",
        "block_id",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # NOTE: a block is in the free queue iff ref_cnt == 0 (the null block excepted, which
        # is never queued); a free block may still be cached (block_hash set) until reused.
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        # NOTE: both links are None exactly when the block is not in a free queue.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def reset_hash(self) -> None:
        """Forget the block's hash (it is evicted from the prefix cache)."""
        self.block_hash = None

    def __repr__(self) -> str:
        digest = None if self.block_hash is None else self.block_hash[-8:].hex()
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={digest}, is_null={self.is_null})"
        )
