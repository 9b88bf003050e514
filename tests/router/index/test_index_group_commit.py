"""Changes and group commit: folded per key while a write is in flight, in order, one send
for all workers, errors surfaced per worker; the wrapper over a Redis store."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from events.hashing import BlockKey
from events.identity import WorkerId
from router.errors import PrefixIndexError
from router.index.changes import Changes, transition
from router.index.group_commit import GroupCommit, GroupCommitIndex
from router.index.redis_index import RedisPrefixIndex
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.store.scripts import StaleLeaseError
from router.workers.registry import WorkerRegistry
from tests.support.index_env import drop_namespace

W = WorkerId("w")
V = WorkerId("v")


def change(key: int, old: int, new: int, tag: int = 1) -> Changes:
    changes = Changes()
    changes.note(BlockKey(tag), BlockKey(key), old, new)
    return changes


def test_notes_keep_first_old_and_latest_new_and_drop_no_ops() -> None:
    pending = Changes()
    steps = ((5, 0, 1, 1), (5, 1, 3, 1), (6, 2, 0, 1), (7, 0, 1, 2), (7, 1, 0, 2))
    for key, old, new, tag in steps:  # 7: added then removed
        pending.note(BlockKey(tag), BlockKey(key), old, new)
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


@pytest.mark.slow
@given(history=steps)
@example(history=[(0, 0, [1], 1), (0, 0, [1], 0)])  # noted in the batch that added it
@example(history=[(0, 0, [1], 1), (0, 0, [1, 2], 2)])  # a tier move after it
def test_bulk_added_families_note_and_list_as_notes_do(
    history: list[tuple[int, int, list[int], int]],
) -> None:
    """Changes folded with bulk adds (where the keys are new) and notes elsewhere equal a
    fold of the same history as notes only, pending set by pending set (a new chunk: the
    sender took the previous one), and a writer's key lists say what the masks say."""
    held: dict[int, int] = {}
    chunk, mixed, as_notes = 0, Changes(), Changes()
    for at, tag, keys, mask in history:
        if at != chunk:
            check_equal(mixed, as_notes)
            chunk, mixed, as_notes = at, Changes(), Changes()
        family = [BlockKey(tag * 10 + k) for k in keys]
        if mask and not any(held.get(k) for k in family):
            mixed.add_new(BlockKey(tag), family, mask)
        else:
            for key in family:
                mixed.note(BlockKey(tag), key, held.get(key, 0), mask)
        for key in family:
            as_notes.note(BlockKey(tag), key, held.get(key, 0), mask)
            held[key] = mask
    check_equal(mixed, as_notes)


def check_equal(mixed: Changes, as_notes: Changes) -> None:
    assert mixed.masks() == as_notes.masks()
    assert mixed.families == as_notes.families
    assert len(mixed) == len(as_notes) and bool(mixed) == bool(as_notes)
    listed: dict[BlockKey, list[int]] = {}
    for _, lists in mixed.key_lists():
        for i, keys in enumerate(lists):
            for key in keys:
                listed.setdefault(key, []).append(i)
    expected = {}
    for key, (old, new) in mixed.masks().items():
        gained, lost = new & ~old, old & ~new
        bits = (gained & 1, lost & 1, gained & 2, lost & 2)
        expected[key] = [i for i, bit in enumerate(bits) if bit]
    assert listed == {k: v for k, v in expected.items() if v}


def fold(commits: GroupCommit, worker: WorkerId, key: int, old: int, new: int) -> None:
    """One batch of a worker, noting one key, folded into its queued changes."""
    commits.queued(worker).note(BlockKey(1), BlockKey(key), old, new)
    commits.send_soon()


def test_changes_fold_into_the_next_write_while_one_is_in_flight() -> None:
    async def main() -> None:
        sent: list[dict[WorkerId, dict[int, tuple[int, int]]]] = []
        release = asyncio.Event()

        async def send(writes: dict[WorkerId, Changes]) -> dict[WorkerId, Exception]:
            sent.append({w: dict(c.masks()) for w, c in writes.items()})
            await release.wait()
            return {}

        commits = GroupCommit(send)
        fold(commits, W, 1, 0, 1)
        await asyncio.sleep(0)  # one loop turn: the sender task takes the first set
        fold(commits, W, 2, 0, 1)
        fold(commits, W, 2, 1, 0)  # added then removed: nothing to write
        fold(commits, W, 3, 0, 2)
        fold(commits, V, 4, 0, 1)  # another worker joins the same send
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
        fold(commits, W, 1, 0, 1)
        with pytest.raises(ConnectionError):
            await commits.flush(W)
        await commits.flush(W)  # raised once
        fold(commits, W, 2, 0, 1)
        with pytest.raises(ConnectionError):
            await commits.flush()

        seen: list[tuple[WorkerId, str]] = []
        reporting = GroupCommit(fail, on_error=lambda w, exc: seen.append((w, str(exc))))
        fold(reporting, W, 1, 0, 1)
        await reporting.flush(W)
        assert seen == [(W, "redis went away")]
        fold(reporting, W, 2, 0, 1)  # nothing kept to raise
        await reporting.close()

    asyncio.run(main())


def test_one_refused_worker_does_not_fail_the_others() -> None:
    async def main() -> None:
        written: list[WorkerId] = []

        async def send(writes: dict[WorkerId, Changes]) -> dict[WorkerId, Exception]:
            written.extend(w for w in writes if w != V)
            return {V: PermissionError("lease lost")}

        commits = GroupCommit(send)
        fold(commits, W, 1, 0, 1)
        fold(commits, V, 2, 0, 1)
        await commits.flush(W)  # W's write landed: nothing to raise
        with pytest.raises(PermissionError):
            fold(commits, V, 3, 0, 1)
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


def test_only_the_queued_changes_are_held() -> None:
    async def main() -> None:
        sent: list[dict[WorkerId, Changes]] = []

        async def send(writes: dict[WorkerId, Changes]) -> dict[WorkerId, Exception]:
            sent.append(writes)
            return {}

        queues = GroupCommit(send)
        queued = queues.queued(W)
        assert queues.holds(W, queued)
        assert not queues.holds(W, Changes()) and not queues.holds(V, queued)
        queued.note(BlockKey(1), BlockKey(2), 0, 1)
        queues.send_soon()
        await queues.flush(W)
        assert not queues.holds(W, queued)  # taken by the sender
        assert [list(writes) for writes in sent] == [[W]]

    asyncio.run(main())


def test_group_commit_over_redis_refuses_changes_not_queued(redis_url: str, namespace: str) -> None:
    """They would be dropped unwritten: the write raises instead."""

    async def main() -> None:
        client = await connect(redis_url)
        layout = KeyLayout(namespace)
        store = GroupCommitIndex(RedisPrefixIndex(client, layout))
        try:
            lease = await WorkerRegistry(client, layout).acquire(W)
            assert lease is not None
            store.use_lease(W, lease.token)
            with pytest.raises(PrefixIndexError, match="not its queued ones"):
                await store.write(W, change(2, 0, 1))
            queued = store.changes_for(W)
            queued.note(BlockKey(1), BlockKey(2), 0, 1)
            await store.write(W, queued)
            await store.flush(W)
            assert await store.worker_entries(W) == {2: 1}
        finally:
            await store.close()
            await drop_namespace(client, layout)
            await client.aclose()

    asyncio.run(main())


def test_group_commit_over_redis_fails_a_refused_worker_alone(
    redis_url: str, namespace: str
) -> None:
    """Both workers' changes go in one write; the one Redis refuses (a lease it does not
    hold) loses its queued changes, and its failure is raised by its flush, or reported."""

    async def queue(store: GroupCommitIndex, worker: WorkerId, key: int) -> None:
        queued = store.changes_for(worker)
        queued.note(BlockKey(1), BlockKey(key), 0, 1)
        await store.write(worker, queued)

    async def main() -> None:
        client = await connect(redis_url)
        layout = KeyLayout(namespace)
        seen: list[tuple[WorkerId, type[Exception]]] = []
        raising = GroupCommitIndex(RedisPrefixIndex(client, layout))
        reporting = GroupCommitIndex(
            RedisPrefixIndex(client, layout), on_error=lambda w, exc: seen.append((w, type(exc)))
        )
        try:
            lease = await WorkerRegistry(client, layout).acquire(W)
            assert lease is not None
            for store in (raising, reporting):
                store.use_lease(W, lease.token)
                store.use_lease(V, "7:nobody")
            await queue(raising, W, 2)
            await queue(raising, V, 3)
            await raising.flush(W)
            with pytest.raises(StaleLeaseError):
                await raising.flush(V)
            await raising.flush(V)  # raised once
            assert await raising.worker_entries(W) == {2: 1}
            assert await raising.worker_entries(V) == {}
            await queue(reporting, W, 4)
            await queue(reporting, V, 5)
            await reporting.flush()
            assert seen == [(V, StaleLeaseError)]
            assert await reporting.worker_entries(W) == {2: 1, 4: 1}
            assert not reporting.changes_for(V)  # nothing kept to raise, nothing left queued
        finally:
            await raising.close()
            await reporting.close()
            await drop_namespace(client, layout)
            await client.aclose()

    asyncio.run(main())
