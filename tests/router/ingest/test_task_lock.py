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


def test_the_holder_sets_it_down_for_others_and_takes_it_back() -> None:
    async def main() -> None:
        lock, order = TaskLock(), []
        down = asyncio.Event()

        async def holder() -> None:
            async with lock.hold():
                order.append("holder in")
                async with lock.released():  # e.g. waiting on the network
                    down.set()
                    await asyncio.sleep(0)  # let the other task in
                    async with lock.hold():  # a nested hold takes it like anyone
                        order.append("holder nested")
                order.append("holder back")
                assert lock.is_held

        async def other() -> None:
            await down.wait()
            async with lock.hold():
                order.append("other in")

        await asyncio.wait_for(asyncio.gather(holder(), other()), 10)
        assert order == ["holder in", "other in", "holder nested", "holder back"]
        assert not lock.is_held

    asyncio.run(main())


def test_a_holder_cancelled_while_it_has_set_the_lock_down_leaves_it_free() -> None:
    async def main() -> None:
        lock = TaskLock()
        down = asyncio.Event()

        async def holder() -> None:
            async with lock.hold(), lock.released():
                down.set()
                await asyncio.Event().wait()  # cancelled here

        task = asyncio.create_task(holder())
        await asyncio.wait_for(down.wait(), 10)
        async with lock.hold():  # another task holds it when the cancel lands
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert lock.is_held  # the cancelled holder did not release ours
        await asyncio.wait_for(_enter(lock), 5)

    asyncio.run(main())
