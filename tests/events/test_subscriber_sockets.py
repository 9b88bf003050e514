"""The subscriber's ZeroMQ sockets: three per stream, a deliberate limit, 1,000 streams."""

from __future__ import annotations

import asyncio
import resource

import pytest

from events.subscriber import EventSubscriber, SubscriberConfig, SubscriberError, WorkerStream
from tests.support.event_streams import RecordingSink, batch, loopback_publisher
from tests.support.polling import eventually

MAX_SOCKETS = 31
"""Not a multiple of 3: the stream that does not fit fails on its monitor's sockets."""
NUM_STREAMS = 1000
FDS_NEEDED = 8192
"""Per stream: a SUB and a monitor pair (3 eventfds), its connection at both ends."""
ENDPOINT = "tcp://127.0.0.1:9"  # nothing listens (discard); connecting is asynchronous


async def _no_restart() -> bool:
    return False


def _stream(i: int) -> WorkerStream:
    return WorkerStream(f"w{i}", ENDPOINT)


def test_each_stream_takes_three_sockets_and_past_the_limit_a_clear_error() -> None:
    """A stream is a SUB socket and its connection monitor (two sockets). Past the
    context's limit a clear error, nothing is kept, and a removal frees room."""
    fit = MAX_SOCKETS // 3

    async def scenario() -> None:
        config = SubscriberConfig(max_sockets=MAX_SOCKETS)
        async with EventSubscriber(RecordingSink(), config) as sub:
            for i in range(fit):
                await sub.add_worker(_stream(i))
            with pytest.raises(SubscriberError, match="cannot open a socket"):
                await sub.add_worker(_stream(fit))
            assert sub.worker_ids == [f"w{i}" for i in range(fit)]
            await sub.remove_worker(sub.worker_ids[0])  # frees its sockets for another

            async def added() -> bool:  # libzmq frees a closed socket's slot in the background
                try:
                    await sub.add_worker(_stream(fit))
                except SubscriberError:
                    return False
                return True

            await eventually(added, what="a slot freed by the removal")

    asyncio.run(scenario())


@pytest.mark.slow
def test_the_default_limit_takes_a_thousand_streams() -> None:
    """libzmq's own default (1,023 sockets) stopped at 341 streams. All of them
    connect to one real publisher here (no reconnect churn) and hear it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FDS_NEEDED:
        pytest.skip(f"the hard file descriptor limit {hard} is below {FDS_NEEDED}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FDS_NEEDED), hard))

    async def scenario() -> None:
        with loopback_publisher(replay=False) as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                for i in range(NUM_STREAMS):
                    stream = WorkerStream(f"w{i}", pub.address, restart_probe=_no_restart)
                    await sub.add_worker(stream)
                n = 0

                def heard_by_all() -> bool:
                    nonlocal n
                    heard = {b.worker_id for b in sink.batches}
                    if len(heard) < NUM_STREAMS:
                        pub.publish(batch(n))  # until every subscription has joined
                        n += 1
                        return False
                    return True

                await eventually(heard_by_all, what="every stream's first batch")

    asyncio.run(scenario())
