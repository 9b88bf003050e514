"""cancel_and_wait: tasks end even when a cancellation is lost on the way."""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as redis

from events.cancellation import cancel_and_wait


async def _swallows_first_cancel(started: asyncio.Event) -> None:
    """Loses the first cancellation (as a library can), then waits on."""
    started.set()
    with contextlib.suppress(asyncio.CancelledError):  # lost: the task goes on
        await asyncio.Event().wait()
    await asyncio.Event().wait()


def test_a_task_that_loses_its_cancellation_is_cancelled_again() -> None:
    async def main() -> None:
        started = asyncio.Event()
        task = asyncio.create_task(_swallows_first_cancel(started))
        await started.wait()
        await asyncio.wait_for(cancel_and_wait([task]), timeout=30)
        assert task.cancelled()

    asyncio.run(main())


def test_failed_and_finished_tasks_are_consumed() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    async def main() -> None:
        tasks = [asyncio.create_task(fails()), asyncio.create_task(asyncio.sleep(0))]
        await asyncio.sleep(0.01)  # both ended before the call
        await cancel_and_wait(tasks)
        assert all(t.done() for t in tasks)

    asyncio.run(main())


def test_tasks_cancelled_amid_redis_commands_all_end(redis_url: str) -> None:
    """redis-py's asyncio client loses a cancellation that lands as a command completes;
    every task still ends."""

    async def main() -> None:
        client = redis.Redis.from_url(redis_url)
        try:

            async def busy() -> None:
                while True:
                    await client.ping()

            for _ in range(8):
                task = asyncio.create_task(busy())
                await asyncio.sleep(0.002)
                await asyncio.wait_for(cancel_and_wait([task]), timeout=30)
                assert task.done()
        finally:
            await client.aclose()

    asyncio.run(main())
