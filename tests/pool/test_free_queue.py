"""The intrusive free queue: exact orders after each operation, and a model check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pool.block import KVCacheBlock
from pool.free_queue import FreeKVCacheBlockQueue


def make_queue(n: int) -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return FreeKVCacheBlockQueue(blocks), blocks


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [block.block_id for block in queue.get_all_free_blocks()]


def test_initial_order_and_popleft() -> None:
    queue, blocks = make_queue(4)
    assert ids(queue) == [0, 1, 2, 3]
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    assert ids(queue) == [1, 2, 3]
    assert queue.num_free_blocks == len(queue) == 3


def test_popleft_n_takes_the_head_in_order() -> None:
    queue, blocks = make_queue(5)
    assert queue.popleft_n(3) == blocks[:3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in blocks[:3])
    assert ids(queue) == [3, 4]
    assert queue.popleft_n(0) == []
    assert queue.popleft_n(2) == blocks[3:]
    assert ids(queue) == [] and queue.num_free_blocks == 0


def test_remove_from_head_middle_and_tail() -> None:
    queue, blocks = make_queue(5)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert queue.num_free_blocks == 2
    with pytest.raises(ValueError, match="block 2 is not in the free queue"):
        queue.remove(blocks[2])


def test_append_and_prepend_keep_the_given_order() -> None:
    queue, blocks = make_queue(6)
    taken = queue.popleft_n(6)
    queue.append_n([taken[3], taken[1]])
    queue.prepend_n([taken[5], taken[0]])
    assert ids(queue) == [5, 0, 3, 1]
    queue.append(taken[2])
    queue.prepend(taken[4])
    assert ids(queue) == [4, 5, 0, 3, 1, 2]
    assert queue.num_free_blocks == 6
    assert queue.popleft() is blocks[4]


def test_empty_queue_errors() -> None:
    queue, _ = make_queue(1)
    queue.popleft()
    with pytest.raises(ValueError, match="no free blocks available"):
        queue.popleft()
    with pytest.raises(ValueError, match="cannot pop 1 blocks: only 0 are free"):
        queue.popleft_n(1)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["popleft", "popleft_n", "remove", "append", "prepend"]), st.integers(0, 7)
    ),
    max_size=40,
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(OPS)
def test_matches_a_list_model(ops: list[tuple[str, int]]) -> None:
    queue, blocks = make_queue(8)
    model = list(range(8))
    out: list[int] = []  # popped ids, not in the queue
    for op, arg in ops:
        if op == "popleft" and model:
            out.append(queue.popleft().block_id)
            model.pop(0)
        elif op == "popleft_n" and arg <= len(model):
            out.extend(b.block_id for b in queue.popleft_n(arg))
            del model[:arg]
        elif op == "remove" and arg in model:
            queue.remove(blocks[arg])
            model.remove(arg)
            out.append(arg)
        elif op in ("append", "prepend") and out:
            block_id = out.pop(arg % len(out))
            if op == "append":
                queue.append(blocks[block_id])
                model.append(block_id)
            else:
                queue.prepend(blocks[block_id])
                model.insert(0, block_id)
        assert ids(queue) == model
        assert queue.num_free_blocks == len(model)
        for block_id in out:
            assert blocks[block_id].prev_free_block is None
            assert blocks[block_id].next_free_block is None
