"""Group commit: merged per key while a write is in flight, in order, errors surfaced."""

from __future__ import annotations

import asyncio

import pytest

from events.hashing import BlockKey
from router.index.base import WorkerId
from router.index.bridge import Changes, EntryChange
from router.index.group_commit import GroupCommit, merge_changes

W = WorkerId("w")


def change(key: int, old: int, new: int) -> Changes:
    return {BlockKey(key): EntryChange(BlockKey(key), BlockKey(1), old, new)}


def test_merge_keeps_first_old_and_latest_new() -> None:
    pending = change(5, 0, 1)
    merge_changes(pending, change(5, 1, 3))
    merge_changes(pending, change(6, 2, 0))
    assert pending == {**change(5, 0, 3), **change(6, 2, 0)}


def test_changes_merge_while_a_write_is_in_flight() -> None:
    async def main() -> None:
        sent: list[Changes] = []
        release = asyncio.Event()

        async def send(worker_id: WorkerId, changes: Changes) -> None:
            sent.append(changes)
            await release.wait()

        commits = GroupCommit(send)
        commits.submit(W, change(1, 0, 1))
        await asyncio.sleep(0)  # one loop turn: the sender task takes the first set
        commits.submit(W, change(2, 0, 1))
        commits.submit(W, change(2, 1, 0))  # added then removed: nothing to write
        commits.submit(W, change(3, 0, 2))
        release.set()
        await commits.flush(W)
        assert sent == [change(1, 0, 1), change(3, 0, 2)]

    asyncio.run(main())


def test_a_failed_write_is_raised_once_or_reported() -> None:
    async def main() -> None:
        async def fail(worker_id: WorkerId, changes: Changes) -> None:
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
