"""TaskLock: exclusion between tasks, re-entry within the holder, release on every exit."""

from __future__ import annotations

import asyncio

import pytest

from router.ingest.task_lock import TaskLock


def test_tasks_take_turns_and_the_holder_reenters() -> None:
    async def main() -> None:
        lock, order = TaskLock(), []
        inside = asyncio.Event()
        release = asyncio.Event()

        async def first() -> None:
            async with lock.hold():
                order.append("first in")
                async with lock.hold():  # nested in its own hold: no deadlock
                    order.append("first nested")
                inside.set()
                await release.wait()
                order.append("first out")

        async def second() -> None:
            await inside.wait()
            async with lock.hold():
                order.append("second in")

        one, two = asyncio.create_task(first()), asyncio.create_task(second())
        await asyncio.wait_for(inside.wait(), 10)  # a re-entry that blocked would hang here
        for _ in range(5):  # second is waiting for the lock: it cannot get in meanwhile
            await asyncio.sleep(0)
        assert order == ["first in", "first nested"]
        release.set()
        await asyncio.gather(one, two)
        assert order == ["first in", "first nested", "first out", "second in"]

    asyncio.run(main())


def test_an_error_or_a_cancelled_waiter_leaves_it_free() -> None:
    async def main() -> None:
        lock = TaskLock()

        async def fail_nested() -> None:
            async with lock.hold(), lock.hold():  # the second nested in the first
                raise ValueError("inside")

        with pytest.raises(ValueError):
            await asyncio.wait_for(fail_nested(), 10)  # a re-entry that blocked would hang
        async with lock.hold():  # free again (the nested exit did not release it early)
            waiter = asyncio.create_task(_enter(lock))
            for _ in range(3):
                await asyncio.sleep(0)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
        await asyncio.wait_for(_enter(lock), 5)  # neither left it held

    asyncio.run(main())


async def _enter(lock: TaskLock) -> None:
    async with lock.hold():
        pass
