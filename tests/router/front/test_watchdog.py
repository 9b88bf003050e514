"""The silence watchdog's verdicts: a silent worker that fails its probe is given up, its
other attempts with it unless they heard from it since the probe began."""

from __future__ import annotations

import asyncio

from router.front.watchdog import SilenceWatchdog
from tests.support.polling import eventually


def test_a_failed_probe_condemns_only_the_attempts_silent_since_it_began() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        hung_up: list[str] = []
        dead: list[tuple[str, float]] = []

        async def no_answer() -> bool:
            return False

        def watchdog(name: str) -> SilenceWatchdog:
            return SilenceWatchdog(
                window_s=0.05, deadline=loop.time() + 60, probe=no_answer,
                probe_timeout_s=1.0, total_timeout_s=60.0,
                hang_up=lambda: hung_up.append(name),
                on_dead=lambda verdict, since: dead.append((verdict, since)),
            )  # fmt: skip

        first, quiet, talking = watchdog("first"), watchdog("quiet"), watchdog("talking")
        quiet.stop()  # only the first one's timer runs: the others hear only condemn()
        talking.stop()
        await eventually(lambda: bool(dead), "the first watchdog's verdict")
        first.stop()
        ((verdict, since),) = dead
        talking.heard()  # it heard from the worker after the probe began
        for dog in (quiet, talking):
            dog.condemn(verdict, since)
        assert verdict == "silent for 0.05 s and no answer to GET /health within 1 s"
        assert hung_up == ["first", "quiet"]
        assert (quiet.verdict, quiet.unreachable) == (verdict, True)
        assert (talking.verdict, talking.unreachable) == (None, False)

    asyncio.run(asyncio.wait_for(scenario(), 30))
