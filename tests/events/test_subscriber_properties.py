"""Property: whatever PUB loses, the subscriber applies exactly the published sequence."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.subscriber import EventSubscriber, WorkerStream
from tests.support.event_streams import (
    RecordingSink,
    batch,
    batch_id,
    handshake,
    loopback_publisher,
)

# Per round: which batches the PUB socket loses (True = lost, still buffered for replay).
rounds_strategy = st.lists(st.lists(st.booleans(), min_size=1, max_size=12), min_size=1, max_size=4)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(rounds=rounds_strategy)
def test_applied_sequence_equals_published_under_any_loss(rounds: list[list[bool]]) -> None:
    async def scenario() -> None:
        skipped: set[int] = set()
        with loopback_publisher(skip_live_seqs=skipped) as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(WorkerStream("w", pub.address, pub.replay_address))
                await handshake(sink, "w", lambda: pub.publish(batch(pub.next_seq)))
                for losses in rounds:
                    for lost in losses:
                        if lost:
                            skipped.add(pub.next_seq)
                        pub.publish(batch(pub.next_seq))
                    pub.publish(batch(pub.next_seq))  # reveals a loss at the round's end
                    await sink.wait_for(lambda: sub.last_seq("w") == pub.next_seq - 1)
                first = sink.batches[0].seq
                assert sink.seqs("w") == list(range(first, pub.next_seq))
                assert [batch_id(b) for b in sink.batches] == list(range(first, pub.next_seq))
                counters = sub.counters("w")
                assert counters.resyncs == {}
                assert counters.num_resets == 0
                # A replay returns everything buffered, so later losses of the same round
                # may be covered before they show as gaps.
                assert counters.num_gaps == counters.num_replays
                assert counters.num_missed <= len(skipped)
                assert (counters.num_gaps > 0) == bool(skipped)

    asyncio.run(scenario())
