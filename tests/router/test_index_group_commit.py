"""Changes and group commit: merged per key while a write is in flight, in order, one send
for all workers, errors surfaced per worker."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from events.hashing import BlockKey
from router.index.base import WorkerId
from router.index.changes import Changes, transition
from router.index.group_commit import GroupCommit

W = WorkerId("w")
V = WorkerId("v")


def change(key: int, old: int, new: int, tag: int = 1) -> Changes:
    changes = Changes()
    changes.note(BlockKey(tag), BlockKey(key), old, new)
    return changes


def test_merge_keeps_first_old_and_latest_new_and_drops_no_ops() -> None:
    pending = change(5, 0, 1)
    pending.merge(change(5, 1, 3))
    pending.merge(change(6, 2, 0))
    pending.merge(change(7, 0, 1, tag=2))
    pending.merge(change(7, 1, 0, tag=2))  # added then removed: nothing left
    assert pending.families == {1: {5: transition(0, 3), 6: transition(2, 0)}}
    assert pending.masks() == {5: (0, 3), 6: (2, 0)}
    assert len(pending) == 2


def test_add_new_in_bulk_equals_notes_one_by_one() -> None:
    bulk, single = change(2, 1, 0), change(2, 1, 0)
    bulk.add_new(BlockKey(1), [BlockKey(k) for k in (2, 3, 4)], 1)
    for key in (2, 3, 4):
        single.note(BlockKey(1), BlockKey(key), 0, 1)
    # Key 2 went 1 -> 0 -> 1: no change left to write.
    assert bulk.families == single.families == {1: {3: transition(0, 1), 4: transition(0, 1)}}
    fresh = Changes()
    fresh.add_new(BlockKey(1), [BlockKey(3), BlockKey(4)], 2)
    assert fresh.masks() == {3: (0, 2), 4: (0, 2)}


notes = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(0, 3), st.integers(0, 3)),
    max_size=40,
)


@given(first=notes, second=notes)
def test_merge_equals_noting_everything_in_one(
    first: list[tuple[int, int, int, int]], second: list[tuple[int, int, int, int]]
) -> None:
    """Merging two folds equals one fold of both, for chained transitions per key."""

    def fold(into: Changes, seq: list[tuple[int, int, int, int]], held: dict[int, int]) -> None:
        for tag, key, _, new in seq:
            k = tag * 10 + key  # a key belongs to one family
            into.note(BlockKey(tag), BlockKey(k), held.get(k, 0), new)
            held[k] = new

    held: dict[int, int] = {}
    whole = Changes()
    fold(whole, first + second, dict(held))
    a, b = Changes(), Changes()
    fold(a, first, held)
    fold(b, second, held)
    a.merge(b)
    assert a.masks() == whole.masks()
    assert all(old != new for old, new in a.masks().values())


# One step of a worker's history: (chunk, tag, keys, mask). A key is new (added in bulk
# with the others of its step) where the worker does not hold it, else its mask is noted.
steps = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.integers(0, 2),
        st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
        st.integers(0, 3),
    ),
    max_size=30,
)


@given(history=steps)
@example(history=[(0, 0, [1], 1), (0, 0, [1], 0)])  # noted in the batch that added it
@example(history=[(0, 0, [1], 1), (1, 0, [1, 2], 2)])  # in a later batch
def test_bulk_added_families_merge_and_list_as_notes_do(
    history: list[tuple[int, int, list[int], int]],
) -> None:
    """Changes folded in chunks (bulk adds where the keys are new, notes elsewhere) and
    merged in order equal one fold of the same history as notes only, and a writer's
    key lists say what the masks say."""
    held: dict[int, int] = {}
    whole, merged, chunk, current, as_notes = Changes(), Changes(), 0, Changes(), Changes()
    for at, tag, keys, mask in history:
        if at != chunk:  # a new batch: the previous one is merged into the pending
            assert current.masks() == as_notes.masks()
            merged.merge(current)
            current, chunk, as_notes = Changes(), at, Changes()
        family = [BlockKey(tag * 10 + k) for k in keys]
        new = [k for k in family if not held.get(k)]
        if mask and len(new) == len(family):
            current.add_new(BlockKey(tag), family, mask)
        else:
            for key in family:
                current.note(BlockKey(tag), key, held.get(key, 0), mask)
        for key in family:
            for notes_only in (whole, as_notes):
                notes_only.note(BlockKey(tag), key, held.get(key, 0), mask)
            held[key] = mask
    assert current.masks() == as_notes.masks()
    merged.merge(current)
    assert merged.masks() == whole.masks()
    assert merged.families == whole.families
    assert len(merged) == len(whole) and bool(merged) == bool(whole)
    listed: dict[BlockKey, list[int]] = {}
    for _, lists in merged.key_lists():
        for i, keys in enumerate(lists):
            for key in keys:
                listed.setdefault(key, []).append(i)
    expected = {}
    for key, (old, new_mask) in merged.masks().items():
        gained, lost = new_mask & ~old, old & ~new_mask
        bits = (gained & 1, lost & 1, gained & 2, lost & 2)
        expected[key] = [i for i, bit in enumerate(bits) if bit]
    assert listed == {k: v for k, v in expected.items() if v}


def test_changes_merge_while_a_write_is_in_flight() -> None:
    async def main() -> None:
        sent: list[dict[WorkerId, dict[int, tuple[int, int]]]] = []
        release = asyncio.Event()

        async def send(writes: dict[WorkerId, Changes]) -> dict[WorkerId, Exception]:
            sent.append({w: dict(c.masks()) for w, c in writes.items()})
            await release.wait()
            return {}

        commits = GroupCommit(send)
        commits.submit(W, change(1, 0, 1))
        await asyncio.sleep(0)  # one loop turn: the sender task takes the first set
        commits.submit(W, change(2, 0, 1))
        commits.submit(W, change(2, 1, 0))  # added then removed: nothing to write
        commits.submit(W, change(3, 0, 2))
        commits.submit(V, change(4, 0, 1))  # another worker joins the same send
        release.set()
        await commits.flush(W)
        await commits.flush()
        assert sent == [{W: {1: (0, 1)}}, {W: {3: (0, 2)}, V: {4: (0, 1)}}]

    asyncio.run(main())


def test_a_failed_write_is_raised_once_or_reported() -> None:
    async def main() -> None:
        async def fail(writes: dict[WorkerId, Changes]) -> dict[WorkerId, Exception]:
            raise ConnectionError("redis went away")

        commits = GroupCommit(fail)
        commits.submit(W, change(1, 0, 1))
        with pytest.raises(ConnectionError):
            await commits.flush(W)
        await commits.flush(W)  # raised once
        commits.submit(W, change(2, 0, 1))
        with pytest.raises(ConnectionError):
            await commits.flush()

        seen: list[tuple[WorkerId, str]] = []
        reporting = GroupCommit(fail, on_error=lambda w, exc: seen.append((w, str(exc))))
        reporting.submit(W, change(1, 0, 1))
        await reporting.flush(W)
        assert seen == [(W, "redis went away")]
        reporting.submit(W, change(2, 0, 1))  # nothing kept to raise
        await reporting.close()

    asyncio.run(main())


def test_one_refused_worker_does_not_fail_the_others() -> None:
    async def main() -> None:
        written: list[WorkerId] = []

        async def send(writes: dict[WorkerId, Changes]) -> dict[WorkerId, Exception]:
            written.extend(w for w in writes if w != V)
            return {V: PermissionError("lease lost")}

        commits = GroupCommit(send)
        commits.submit(W, change(1, 0, 1))
        commits.submit(V, change(2, 0, 1))
        await commits.flush(W)  # W's write landed: nothing to raise
        with pytest.raises(PermissionError):
            commits.submit(V, change(3, 0, 1))
        assert written == [W]
        await commits.close()

    asyncio.run(main())


def test_flush_sends_what_was_folded_in_but_not_sent_on() -> None:
    # A fold that raised half-way leaves changes queued without starting the sender: a
    # flush (as clear_worker does before clearing) must write them, not leave them to
    # land after the clear.
    async def main() -> None:
        sent: list[dict[WorkerId, dict[int, tuple[int, int]]]] = []

        async def send(writes: dict[WorkerId, Changes]) -> dict[WorkerId, Exception]:
            sent.append({w: dict(c.masks()) for w, c in writes.items()})
            return {}

        commits = GroupCommit(send)
        commits.queued(W).add_new(BlockKey(1), [BlockKey(5)], 1)
        commits.queued(V)  # nothing folded: nothing sent for it
        await commits.flush(W)
        assert sent == [{W: {5: (0, 1)}}]
        await commits.flush()
        assert sent == [{W: {5: (0, 1)}}]

    asyncio.run(main())
