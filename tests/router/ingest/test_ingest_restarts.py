"""Ingest: a worker restarted in place is reset even when nothing in its seqs says so.

Real publishers, ZeroMQ, HTTP and Redis. The old lifetime ended at seq L - 1 and the new
lifetime's first L batches are lost, so the first batch the router sees is seq L: the
stream looks continuous (or, when the worker stays quiet, nothing is seen at all). Only
the worker's lifetime tells: a kvroute worker's id in ``GET /health``, a vLLM engine's
``process_start_time_seconds`` in ``GET /metrics``. It is asked on the first batch after
the connection dropped, and by every maintenance pass.

The live stream goes through a :class:`LiveRelay`, so the test decides exactly which
batches reach the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
import pytest
from aiohttp import web

from tests.support.ingest import (
    BY_HAND,
    FakeWorker,
    LifetimeWorker,
    Stack,
    divergent,
    fake_workers,
    keys,
    lookup_is,
    match,
    stack,
    stored,
    stream_count,
)
from tests.support.live_relay import EverySeq, LiveRelay
from tests.support.polling import eventually

Kind = Literal["kvroute", "vllm"]

PERIODIC = {"maintain_interval_s": 0.2}
"""A maintenance pass (and its lifetime check) every 0.2 s."""


class VllmWorker(FakeWorker):
    """A vLLM-protocol worker: events and replay, no snapshot, no lifetime id; its
    ``GET /metrics`` has ``process_start_time_seconds``, new with each restart."""

    def __init__(self, worker_id: str, **kwargs: Any) -> None:
        super().__init__(worker_id, kind="vllm", **kwargs)
        self.start_time = 1_700_000_000.25

    async def start(self) -> VllmWorker:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.http_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def _metrics(self, _: web.Request) -> web.Response:
        body = (
            "# HELP process_start_time_seconds Start time of the process since unix epoch.\n"
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {self.start_time}\n"
            "vllm:num_requests_running 0.0\n"
        )
        return web.Response(text=body, content_type="text/plain")

    def restart_publisher(self) -> None:
        super().restart_publisher()
        self.start_time += 17.0


def make_worker(kind: Kind) -> FakeWorker:
    # The publisher sends nothing live: the relay does.
    if kind == "kvroute":
        return LifetimeWorker("k1", skip_live_seqs=EverySeq())  # type: ignore[arg-type]
    return VllmWorker("k1", skip_live_seqs=EverySeq())


async def old_lifetime(s: Stack, k1: FakeWorker, relay: LiveRelay) -> None:
    """Seqs 0..2 of the old lifetime, relayed and ingested (prompts 1 and 3)."""
    await asyncio.to_thread(relay.wait_subscribed)
    for events in ([stored(1, 0, 2)], [stored(1, 2, 2)], [stored(3, 0, 1)]):
        relay.send(k1.publish(*events), k1.last_batch)
    await eventually(lookup_is(s.index, 1, {"k1": match(4)}), what="the old lifetime")
    await eventually(lookup_is(s.index, 3, {"k1": match(1)}), what="the old lifetime")
    assert k1.publisher.next_seq == 3


@contextlib.asynccontextmanager
async def after_old_lifetime(
    redis_url: str, namespace: str, kind: Kind, **settings: Any
) -> AsyncIterator[tuple[Stack, FakeWorker, LiveRelay]]:
    """A router ingesting one worker whose live stream goes through a relay, once the
    worker's old lifetime (:func:`old_lifetime`) is in the index."""
    with LiveRelay() as relay:
        async with (
            fake_workers(make_worker(kind)) as (k1,),
            stack(redis_url, namespace, **settings) as s,
        ):
            record = msgspec.structs.replace(k1.record(), events_endpoint=relay.address)
            s.ingest.config = dataclasses.replace(s.ingest.config, lifetime_timeout_s=0.5)
            await s.ingest.start([record])
            await old_lifetime(s, k1, relay)
            yield s, k1, relay


def restart_losing_first_batches(k1: FakeWorker, relay: LiveRelay) -> None:
    """Restart the worker in place; its new lifetime's seqs 0..2 are lost on the way."""
    relay.restart()  # the router sees the connection drop
    k1.restart_publisher()
    k1.publish(stored(2, 0, 3))
    k1.publish()
    k1.publish()


@pytest.mark.parametrize("kind", ["kvroute", "vllm"])
def test_a_restart_that_looks_continuous_is_a_reset(
    redis_url: str, namespace: str, kind: Kind
) -> None:
    """First seen after the restart: seq 3, the next after the old lifetime's last."""

    async def main() -> None:
        async with after_old_lifetime(redis_url, namespace, kind, **BY_HAND) as (s, k1, relay):
            # (A vLLM engine taken over is replayed from seq 0 at its first batch.)
            replayed = stream_count(s, "replayed_batches", "k1")
            restart_losing_first_batches(k1, relay)
            await asyncio.to_thread(relay.wait_subscribed)  # reconnected
            relay.send(k1.publish(), k1.last_batch)  # seq 3
            await eventually(lookup_is(s.index, 2, {"k1": match(3)}), what="new lifetime")
            assert dict(await s.index.lookup(keys(1))) == {}
            assert dict(await s.index.lookup(keys(3))) == {}
            if kind == "kvroute":
                assert await divergent(s.index, k1) == 0
            assert stream_count(s, "resets", "k1") == 1
            assert s.count("resets", worker="k1") == 1
            assert stream_count(s, "gaps", "k1") == 1  # the new lifetime from seq 0
            # 0..3: the replay reaches the batch that revealed the restart too.
            assert stream_count(s, "replayed_batches", "k1") == replayed + 4
            assert stream_count(s, "resyncs", "k1") == 0

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kvroute", "vllm"])
def test_a_quiet_restart_is_found_by_the_periodic_check(
    redis_url: str, namespace: str, kind: Kind
) -> None:
    """Nothing of the new lifetime reaches the router: the maintenance pass finds it. A
    kvroute worker is reloaded from its snapshot at once; a vLLM engine is cleared
    (claiming too little is safe) and replayed from seq 0 at its next batch."""

    async def main() -> None:
        async with after_old_lifetime(redis_url, namespace, kind, **PERIODIC) as (s, k1, relay):
            replays = s.count("replays", worker="k1", outcome="ok")
            restart_losing_first_batches(k1, relay)
            await eventually(lookup_is(s.index, 1, {}), what="old lifetime dropped")
            assert dict(await s.index.lookup(keys(3))) == {}
            if kind == "kvroute":
                await eventually(lookup_is(s.index, 2, {"k1": match(3)}), what="snapshot")
                assert await divergent(s.index, k1) == 0
                assert s.count("snapshots", worker="k1", outcome="ok") == 2
            else:
                await asyncio.to_thread(relay.wait_subscribed)
                relay.send(k1.publish(), k1.last_batch)  # seq 3: replayed from 0
                await eventually(lookup_is(s.index, 2, {"k1": match(3)}), what="replayed")
                assert s.count("replays", worker="k1", outcome="ok") == replays + 1
            assert s.count("resets", worker="k1") == 1
            assert stream_count(s, "resyncs", "k1") == 0

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kvroute", "vllm"])
def test_a_restart_found_first_by_the_periodic_check_is_reset_once(
    redis_url: str, namespace: str, kind: Kind
) -> None:
    """The maintenance pass finds the new lifetime and resets the worker (a kvroute worker
    from its snapshot); then the stream shows the same restart as a seq drop (a batch of
    the new lifetime below the old lifetime's last seq). That is the restart already
    handled: counted and reset once, nothing reset for it is cleared again."""

    async def main() -> None:
        async with after_old_lifetime(redis_url, namespace, kind, **PERIODIC) as (s, k1, relay):
            relay.restart()  # after seqs 0..2
            k1.restart_publisher()
            k1.publish(stored(2, 0, 3))  # seq 0 of the new lifetime, lost on the way
            await eventually(lookup_is(s.index, 1, {}), what="old lifetime dropped")
            if kind == "kvroute":
                await eventually(lookup_is(s.index, 2, {"k1": match(3)}), what="snapshot")
            await asyncio.to_thread(relay.wait_subscribed)
            seq = k1.publish(stored(4, 0, 1))
            assert seq == 1  # below the old lifetime's last seq: a drop
            relay.send(seq, k1.last_batch)
            await eventually(lookup_is(s.index, 4, {"k1": match(1)}), what="seq 1")
            await eventually(lookup_is(s.index, 2, {"k1": match(3)}), what="seq 0")
            assert s.count("resets", worker="k1") == 1
            assert stream_count(s, "resets", "k1") == 1
            assert stream_count(s, "resyncs", "k1") == 0

    asyncio.run(main())
