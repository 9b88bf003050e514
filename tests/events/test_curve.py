"""CURVE-authenticated event streams: allowed subscribers get events, forgers and strangers none."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from events.cli.keys import main as keys_main
from events.curve import (
    CurveClientConfig,
    CurveKeyError,
    CurveKeyPair,
    CurveServerConfig,
    load_public_key,
    write_keypair,
)
from events.publisher import EventPublisher
from events.subscriber import EventSubscriber, WorkerStream
from tests.support.event_streams import RecordingSink, batch, handshake, loopback_publisher

SERVER = CurveKeyPair.generate()
ROUTER = CurveKeyPair.generate()
STRANGER = CurveKeyPair.generate()


def secured_publisher(
    server: CurveKeyPair = SERVER, skip_live_seqs: set[int] | None = None
) -> EventPublisher:
    return loopback_publisher(
        curve=CurveServerConfig(server, allowed_client_keys=frozenset({ROUTER.public_key})),
        skip_live_seqs=skip_live_seqs,
    )


def client_stream(
    worker_id: str, pub: EventPublisher, client: CurveKeyPair | None, server_key: bytes
) -> WorkerStream:
    curve = CurveClientConfig(server_key, client) if client is not None else None
    return WorkerStream(worker_id, pub.address, pub.replay_address, curve=curve)


def test_allowed_subscriber_receives_live_and_replayed_batches() -> None:
    async def scenario() -> None:
        skipped: set[int] = set()
        with secured_publisher(skip_live_seqs=skipped) as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(client_stream("w", pub, ROUTER, SERVER.public_key))
                await handshake(sink, "w", lambda: pub.publish(batch(0)))
                skipped.add(pub.next_seq)
                pub.publish(batch(1))
                pub.publish(batch(2))
                await sink.wait_for(lambda: sub.last_seq("w") == pub.next_seq - 1)
                replayed = [b.seq for b in sink.batches if b.replayed]
                assert replayed[0] == pub.next_seq - 2
                assert sub.counters("w").resyncs == {}
                assert sub.counters("w").num_handshake_failures == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("client", [STRANGER, None], ids=["not-on-allow-list", "no-curve"])
def test_unauthorised_subscriber_gets_nothing(client: CurveKeyPair | None) -> None:
    async def scenario() -> None:
        with secured_publisher() as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(client_stream("bad", pub, client, SERVER.public_key))
                await sub.add_worker(client_stream("good", pub, ROUTER, SERVER.public_key))
                await sink.wait_for(
                    lambda: sub.counters("bad").num_handshake_failures >= 1,
                    poke=lambda: pub.publish(batch(0)),
                )
                await handshake(sink, "good", lambda: pub.publish(batch(0)))
                for i in range(20):
                    pub.publish(batch(i))
                await sink.wait_for(lambda: sub.last_seq("good") == pub.next_seq - 1)
                assert sink.seqs("bad") == []
                assert sub.last_seq("bad") is None

    asyncio.run(scenario())


def test_forged_publisher_never_delivers() -> None:
    async def scenario() -> None:
        forger = CurveKeyPair.generate()
        with secured_publisher() as genuine, secured_publisher(server=forger) as forged:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                # The forger answers at an address the subscriber trusts, with its own keys.
                await sub.add_worker(client_stream("w1", forged, ROUTER, SERVER.public_key))
                await sub.add_worker(client_stream("w2", genuine, ROUTER, SERVER.public_key))
                await sink.wait_for(
                    lambda: sub.counters("w1").num_handshake_failures >= 1,
                    poke=lambda: forged.publish(batch(666)),
                )
                await handshake(sink, "w2", lambda: genuine.publish(batch(0)))
                for i in range(20):
                    forged.publish(batch(666))
                    genuine.publish(batch(i))
                await sink.wait_for(lambda: sub.last_seq("w2") == genuine.next_seq - 1)
                assert sink.seqs("w1") == []

    asyncio.run(scenario())


def test_key_files_round_trip_and_are_never_overwritten(tmp_path: Path) -> None:
    public_path, secret_path = write_keypair(tmp_path / "keys", "worker-1")
    assert (public_path.name, secret_path.name) == ("worker-1.key", "worker-1.key_secret")
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600
    pair = CurveKeyPair.load(secret_path)
    assert load_public_key(public_path) == pair.public_key
    assert "secret_key=<hidden>" in repr(pair)
    with pytest.raises(CurveKeyError, match="exists"):
        write_keypair(tmp_path / "keys", "worker-1")
    with pytest.raises(CurveKeyError, match="holds no secret key"):
        CurveKeyPair.load(public_path)
    with pytest.raises(CurveKeyError, match="cannot read"):
        load_public_key(tmp_path / "missing.key")
    with pytest.raises(CurveKeyError, match="40 characters"):
        CurveClientConfig(b"short", pair)


def test_keys_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_main(["--out", str(tmp_path), "--name", "router"]) == 0
    public = load_public_key(tmp_path / "router.key")
    assert f"({public.decode()})" in capsys.readouterr().out
    assert keys_main(["--out", str(tmp_path), "--name", "router"]) == 1
