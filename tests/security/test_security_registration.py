"""A bad registration never stops a router, and no start-up path of ``kvroute router`` hangs.

* A registration saved in Redis that is invalid (here an events endpoint ``"garbage"``,
  as ``POST /v1/workers`` used to save before answering 500) is skipped by a router
  started later on that namespace: one WARNING naming the worker and the problem, the
  counter ``kvroute_router_invalid_registrations_total``, and the router serves.
* Every start-up failure (HTTP port taken, Redis unreachable, a configured worker that is
  invalid or refused, a flag that contradicts another) exits non-zero with a clear
  message within a bound, the processes are real subprocesses.
* An event subscription that cannot be set up leaves no socket open, so closing the
  subscriber returns (a leaked socket blocked the ZeroMQ context's term for ever).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
import redis

from router.cluster.runner import ProcessGroup, wait_healthy
from router.store.layout import KeyLayout
from router.store.server import free_port
from router.workers.registry import WorkerRecord

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 90.0
"""A router that is going to start does so well within this, even on a loaded machine."""
EXIT_BOUND_S = 60.0
"""A router that cannot start exits within this (Redis retries included)."""


def kvroute(*args: str) -> list[str]:
    return [sys.executable, "-m", "router", *args]


@pytest.fixture
def registry_hash(redis_url: str, namespace: str) -> Iterator[tuple[redis.Redis, str]]:
    """A client of the suite's Redis and the registry key of this test's namespace."""
    client = redis.Redis.from_url(redis_url)
    layout = KeyLayout(namespace)
    try:
        yield client, layout.registry
    finally:
        for key in client.scan_iter(match=layout.prefix + "*"):
            client.delete(key)
        client.close()


def test_a_router_skips_a_bad_saved_registration_and_serves(
    tmp_path: Path, redis_url: str, namespace: str, registry_hash: tuple[redis.Redis, str]
) -> None:
    client, key = registry_hash
    good = WorkerRecord(
        worker_id="good", events_endpoint="tcp://127.0.0.1:1", http_url="http://127.0.0.1:1"
    )
    client.hset(key, "bad", b'{"worker_id": "bad", "events_endpoint": "garbage"}')
    client.hset(key, "good", msgspec.json.encode(good))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = kvroute("router", "--redis", redis_url, "--namespace", namespace, "--port", str(port))

    async def serving() -> tuple[list[str], str]:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, group, time.monotonic() + START_TIMEOUT_S)
            async with session.get(f"{url}/v1/workers") as resp:
                workers = [w["worker_id"] for w in (await resp.json())["workers"]]
            async with session.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
        return workers, metrics

    with ProcessGroup(tmp_path) as group:
        group.start("router", argv)
        workers, metrics = asyncio.run(serving())
        log = group.log_tail("router", 100_000)
    assert workers == ["good"]
    assert "kvroute_router_invalid_registrations_total 1.0" in metrics
    warnings = [line for line in log.splitlines() if " WARNING " in line and "'bad'" in line]
    assert len(warnings) == 1, log
    assert (
        "skipping the registration of worker 'bad' stored in Redis: events endpoint "
        in (warnings[0])
    )
    assert "'garbage': expected tcp://HOST:PORT or ipc://PATH" in warnings[0]
    assert client.hget(key, "bad") is not None  # left for the operator to fix or remove


def _start_fails(argv: list[str]) -> str:
    """Run a router that must fail to start; returns its stderr."""
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the router hung at start for {EXIT_BOUND_S}s: {exc.stderr!r}")
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < EXIT_BOUND_S
    assert done.stdout == ""  # never announced itself ready
    return done.stderr


def test_a_taken_http_port_is_a_clear_exit(redis_url: str, namespace: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for redis_flags in (["--redis", redis_url], []):  # [] starts an embedded Redis
            stderr = _start_fails(
                kvroute("router", *redis_flags, "--namespace", namespace, "--port", str(port))
            )
            assert f"router failed: cannot listen on 127.0.0.1:{port}: " in stderr
            assert "choose another --host/--port" in stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--redis", "redis://127.0.0.1:{free}/0"], "cannot reach Redis at redis://127.0.0.1:"),
        (
            ["--worker", "w=http://127.0.0.1:1,events=garbage"],
            "events endpoint 'garbage': expected tcp://HOST:PORT or ipc://PATH",
        ),
        (
            ["--worker", "w=http://127.0.0.1:1,events=tcp://127.0.0.1:2",
             "--allow-worker-net", "10.0.0.0/8"],
            "url host '127.0.0.1' is outside the networks this router may reach",
        ),
        (
            ["--worker", "w=http://127.0.0.1:{port},events=tcp://127.0.0.1:2"],
            "is this router's own address",
        ),
        (["--require-curve"], "--require-curve needs --client-key"),
        (["--allow-worker-net", "10.0.0.0/99"], "--allow-worker-net '10.0.0.0/99': expected"),
        (["--admin-key", "a", "--admin-key-file", "k"], "give --admin-key or --admin-key-file"),
    ],
)  # fmt: skip
def test_no_start_up_failure_hangs(
    redis_url: str, namespace: str, flags: list[str], message: str
) -> None:
    port = free_port()
    flags = [f.format(free=free_port(), port=port) for f in flags]
    if "--redis" not in flags:
        flags += ["--redis", redis_url]
    argv = kvroute("router", "--namespace", namespace, "--port", str(port), *flags)
    stderr = _start_fails(argv)
    assert "router failed: " in stderr and message in stderr, stderr


SUBSCRIBE_AND_CLOSE = """
import asyncio
from events.subscriber import EventSubscriber, SubscriberError, WorkerStream

class Sink:
    async def on_batch(self, received): pass
    async def on_reset(self, worker_id, seq): pass
    async def on_resync_needed(self, worker_id, reason): pass

async def main():
    subscriber = EventSubscriber(Sink())
    try:
        await subscriber.add_worker(WorkerStream("w", "tcp://-not-a-host:1"))
    except SubscriberError as exc:
        print("refused:", exc)
    await subscriber.close()
    print("closed")

asyncio.run(main())
"""


def test_a_failed_subscription_leaves_nothing_open() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SUBSCRIBE_AND_CLOSE],
        capture_output=True,
        text=True,
        timeout=EXIT_BOUND_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "refused: worker 'w': cannot subscribe to its events endpoint 'tcp://-not-a-host:1' "
        "(Invalid argument); expected e.g. tcp://HOST:PORT",
        "closed",
    ]
