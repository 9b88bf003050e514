"""CURVE-authenticated event streams, on by configuration, end to end across processes.

Keys come from ``kvroute keys``; the publisher (a library publisher configured from the
key files, and a ``kvroute worker`` given ``--curve-secret-key`` / ``--curve-allow``) has
an allow-list; ``kvroute record`` processes subscribe: one with an allowed client key
(it records every batch), one with a key the worker does not allow and one without CURVE
(both record nothing, and the first logs the failed handshake).

The router's side (``kvroute router --client-key``, ``--worker ...,server_key=FILE``) is
covered by :mod:`test_security_curve_router`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from events.cli.keys import main as keys_main
from events.curve import CurveKeyPair, CurveServerConfig, load_public_key
from events.endpoints import Endpoint
from events.publisher import EventPublisher, PublisherConfig
from events.recorder import LogRecord, read_log
from events.schema import BlockStored, KVEventBatch
from router.cluster.runner import ProcessGroup, wait_healthy
from router.store.server import free_port
from tests.support.polling import wait_until

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
NUM_BATCHES = 20


def batch(n: int) -> KVEventBatch:
    return KVEventBatch(
        ts=float(n),
        events=[
            BlockStored(
                block_hashes=[n],
                parent_block_hash=None,
                token_ids=[n, n, n, n],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
    )


def records(path: Path) -> list[LogRecord]:
    return list(read_log(path)) if path.exists() and path.stat().st_size > 0 else []


def record_argv(args: list[str], log: Path) -> list[str]:
    """``kvroute record ARGS`` writing to ``log``, flushed often."""
    out = ["--out", str(log), "--flush-interval-s", "0.05"]
    return [sys.executable, "-m", "router", "record", *args, *out]


def test_only_the_allowed_subscriber_receives_events(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    for name in ("worker", "recorder", "intruder"):
        assert keys_main(["--out", str(keys), "--name", name]) == 0
    server = CurveServerConfig(
        CurveKeyPair.load(keys / "worker.key_secret"),
        allowed_client_keys=frozenset({load_public_key(keys / "recorder.key")}),
    )
    publisher = EventPublisher(
        PublisherConfig(
            endpoint=Endpoint.binding("tcp://127.0.0.1:*"),
            replay_endpoint=Endpoint.binding("tcp://127.0.0.1:*"),
            curve=server,
        )
    )
    logs = {name: tmp_path / f"{name}.kvlog" for name in ("allowed", "intruder", "plain")}
    spec = f"w={publisher.address},replay={publisher.replay_address}"
    secured = f"{spec},server_key={keys / 'worker.key'}"
    argv = {
        "allowed": ["--client-key", str(keys / "recorder.key_secret"), "--worker", secured],
        "intruder": ["--client-key", str(keys / "intruder.key_secret"), "--worker", secured],
        "plain": ["--worker", spec],
    }
    try:
        with ProcessGroup(tmp_path / "procs") as group:
            procs = {name: group.start(name, record_argv(argv[name], logs[name])) for name in argv}

            def probe() -> None:
                group.check_alive()
                publisher.publish(batch(publisher.next_seq))

            # Handshakes: the allowed recorder has a batch, the intruder and the plain one a
            # failed handshake (logged once each is up, with its SIGTERM handler: stopped any
            # earlier, a recorder still starting dies of the signal instead of exiting 0).
            wait_until(
                lambda: bool(records(logs["allowed"])),
                "the allowed recorder",
                poke=probe,
                timeout_s=TIMEOUT_S,
            )
            for name in ("intruder", "plain"):
                wait_until(
                    lambda name=name: "handshake with" in group.log_tail(name, 100_000),
                    f"the {name} recorder's failed handshake",
                    poke=probe,
                    timeout_s=TIMEOUT_S,
                )
            first = records(logs["allowed"])[0].seq
            assert first is not None
            last = publisher.next_seq + NUM_BATCHES - 1
            for _ in range(NUM_BATCHES):
                publisher.publish(batch(publisher.next_seq))
            wait_until(
                lambda: (records(logs["allowed"]) or [None])[-1].seq == last,  # type: ignore[union-attr]
                "every batch at the allowed recorder",
                timeout_s=TIMEOUT_S,
            )
            for proc in procs.values():  # SIGTERM: each recorder flushes and exits 0
                proc.terminate()
            codes = {name: proc.wait(TIMEOUT_S) for name, proc in procs.items()}
            assert codes == {"allowed": 0, "intruder": 0, "plain": 0}
    finally:
        publisher.close()
    allowed = records(logs["allowed"])
    assert [r.kind for r in allowed] == ["batch"] * len(allowed)
    assert [r.seq for r in allowed] == list(range(first, last + 1))
    assert [r.decode() for r in allowed] == [batch(seq) for seq in range(first, last + 1)]
    assert records(logs["intruder"]) == []
    assert records(logs["plain"]) == []


def test_worker_cli_curve_flags_end_to_end(tmp_path: Path) -> None:
    """``kvroute worker --curve-secret-key --curve-allow`` to ``kvroute record`` processes."""
    pytest.importorskip("torch")
    keys = tmp_path / "keys"
    for name in ("worker", "recorder", "intruder"):
        assert keys_main(["--out", str(keys), "--name", name]) == 0
    http, events, replay = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{http}"
    spec = f"w=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay}"
    secured = f"{spec},server_key={keys / 'worker.key'}"
    logs = {name: tmp_path / f"{name}.kvlog" for name in ("allowed", "intruder")}
    argv = {
        "allowed": ["--client-key", str(keys / "recorder.key_secret"), "--worker", secured],
        "intruder": ["--client-key", str(keys / "intruder.key_secret"), "--worker", secured],
    }
    prompts = (f"{n:04d} curve probe" for n in itertools.count())  # block 0 differs

    def complete() -> None:
        body = json.dumps({"prompt": next(prompts), "max_tokens": 1}).encode()
        request = urllib.request.Request(
            f"{url}/v1/completions", body, {"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            assert response.status == 200

    def next_seq() -> int:
        with urllib.request.urlopen(f"{url}/v1/snapshot", timeout=TIMEOUT_S) as response:
            return int(json.loads(response.read())["next_seq"])

    with ProcessGroup(tmp_path / "procs") as group:
        group.start(
            "worker",
            [sys.executable, "-m", "router", "worker", "--port", str(http),
             "--events", f"tcp://127.0.0.1:{events}", "--replay", f"tcp://127.0.0.1:{replay}",
             "--curve-secret-key", str(keys / "worker.key_secret"),
             "--curve-allow", str(keys / "recorder.key"),
             "--num-blocks", "64", "--block-size", "4",
             "--num-layers", "1", "--hidden-size", "16", "--num-heads", "2"],
        )  # fmt: skip

        async def ready() -> None:
            async with aiohttp.ClientSession() as session:
                await wait_healthy(session, url, group, time.monotonic() + 120)

        asyncio.run(ready())
        procs = {name: group.start(name, record_argv(argv[name], logs[name])) for name in argv}

        def probe() -> None:
            group.check_alive()
            complete()

        wait_until(
            lambda: bool(records(logs["allowed"])),
            "the allowed recorder",
            poke=probe,
            timeout_s=TIMEOUT_S,
        )
        wait_until(
            lambda: "handshake with" in group.log_tail("intruder", 100_000),
            "the intruder's failed handshake",
            poke=probe,
            timeout_s=TIMEOUT_S,
        )
        for _ in range(5):
            complete()
        last = next_seq() - 1
        wait_until(
            lambda: records(logs["allowed"])[-1].seq == last,
            "every batch at the allowed recorder",
            timeout_s=TIMEOUT_S,
        )
        for proc in procs.values():
            proc.terminate()
        assert {name: proc.wait(TIMEOUT_S) for name, proc in procs.items()} == {
            "allowed": 0,
            "intruder": 0,
        }
    allowed = records(logs["allowed"])
    first = allowed[0].seq
    assert first is not None
    assert [r.seq for r in allowed] == list(range(first, last + 1))
    assert records(logs["intruder"]) == []
