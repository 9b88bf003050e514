"""RouterService.open: a running replica or an error, never a half-built one left open."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest
import redis

from router.errors import RouterError
from router.front.config import RouterConfig
from router.front.service import RouterService
from router.store.server import RedisServer


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _clients(server: RedisServer) -> int:
    """Connections open on the server, this probe's own excluded."""
    with redis.Redis.from_url(server.url) as probe:
        return int(probe.info("clients")["connected_clients"]) - 1


def test_a_failed_open_closes_every_connection_it_made(private_redis: RedisServer) -> None:
    before = _clients(private_redis)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = RouterConfig(
            redis_url=private_redis.url, namespace="open", port=taken.getsockname()[1]
        )
        with pytest.raises(RouterError, match=r"cannot listen on 127\.0\.0\.1"):
            asyncio.run(RouterService.open(config))
    wait_until(lambda: _clients(private_redis) == before, "the router's Redis clients closed")


def test_open_serves_and_the_context_closes_it(private_redis: RedisServer) -> None:
    before = _clients(private_redis)

    async def scenario() -> None:
        config = RouterConfig(redis_url=private_redis.url, namespace="open", port=0)
        async with await RouterService.open(config) as service:
            assert service.port > 0
            assert _clients(private_redis) > before
            with socket.create_connection(("127.0.0.1", service.port), timeout=5):
                pass  # it listens

    asyncio.run(scenario())
    wait_until(lambda: _clients(private_redis) == before, "the router's Redis clients closed")
