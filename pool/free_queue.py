"""The free block queue: an intrusive doubly linked list of blocks, in eviction order.

The head is the next block :meth:`FreeKVCacheBlockQueue.popleft` hands out; cached blocks
freed by requests join at the tail, so the least recently freed cached block is reused (and
evicted) first. The links live in the blocks themselves (``prev_free_block`` /
``next_free_block``), so every operation is O(1) per block and allocates nothing but the
returned lists. Two sentinel nodes bound the list, so no operation tests for an empty
neighbour.
"""

from __future__ import annotations

from collections.abc import Sequence

from pool.block import KVCacheBlock

__all__ = ["FreeKVCacheBlockQueue"]


class FreeKVCacheBlockQueue:
    """The free blocks of a pool, head (reused first) to tail (reused last).

    Args:
        blocks: The initial free blocks, in order; they must not be in another queue.

    Attributes:
        num_free_blocks: Number of blocks in the queue.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        # NOTE: the sentinels are never handed out; _head.prev_free_block and
        # _tail.next_free_block stay None, every real queued block has both links set.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block.

        Raises:
            ValueError: The queue is empty.
        """
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks available")
        nxt = block.next_free_block
        assert nxt is not None
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` head blocks, head first.

        Raises:
            ValueError: Fewer than ``n`` blocks are queued.
        """
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        if n <= 0:
            return []
        head = self._head
        out: list[KVCacheBlock] = []
        append = out.append
        block = head.next_free_block
        for _ in range(n):
            assert block is not None
            append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue (a free cached block got a hit).

        Raises:
            ValueError: ``block`` is not in a queue.
        """
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the tail (reused last)."""
        self.append_n((block,))

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add ``blocks`` at the tail, in order (``blocks[-1]`` becomes the tail)."""
        if not blocks:
            return
        tail = self._tail
        last = tail.prev_free_block
        assert last is not None
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the head (reused first)."""
        self.prepend_n((block,))

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add ``blocks`` at the head, in order (``blocks[0]`` becomes the head)."""
        if not blocks:
            return
        head = self._head
        first = head.next_free_block
        assert first is not None
        for block in reversed(blocks):
            block.next_free_block = first
            first.prev_free_block = block
            first = block
        first.prev_free_block = head
        head.next_free_block = first
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All queued blocks, head first (O(n); for tests and introspection)."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out

    def __len__(self) -> int:
        return self.num_free_blocks
