"""Redis connections for the router: URL parsing (password, ``rediss://`` TLS), cluster detection.

One asyncio client type per deployment: ``redis.asyncio.Redis`` for a single node,
``redis.asyncio.RedisCluster`` when the server reports ``cluster_enabled:1`` (or the
caller says so). Both parse replies with hiredis; single-node clients also pack commands
in C (redis-py's asyncio connections pack in Python, about 0.3 µs per argument, and
hiredis's packer formats ints through ``str()``, 0.35 µs each: most of the client's time
on an index write of thousands of keys; kvroute's ``router.store._resp`` packs them in 0.03).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeVar
from urllib.parse import urlsplit, urlunsplit

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from events.native import native, native_or
from router.errors import RouterError

__all__ = [
    "FAN_OUT",
    "RedisClient",
    "RedisConnectError",
    "RedisOptions",
    "connect",
    "gather_bounded",
    "is_cluster",
    "redact_url",
    "reply_bytes",
]

log = logging.getLogger(__name__)

RedisClient: TypeAlias = "aioredis.Redis | RedisCluster"
"""An asyncio client of a single node or of a Redis Cluster (bytes replies)."""

_SCHEMES = ("redis", "rediss", "unix")


class RedisConnectError(RouterError, ConnectionError):
    """A Redis URL is invalid or its server cannot be reached."""


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """How to reach Redis beyond what the URL says.

    Attributes:
        cluster: ``True``/``False`` forces the client type; ``None`` asks the server.
        tls_ca_file: CA bundle that signed the server certificate (``rediss://``).
        tls_verify: Verify the server certificate (turn off only for tests).
        socket_timeout_s: Timeout of every socket operation.
        retries: Retries of a command that failed on a connection error or timeout.
        retry_timeouts: Whether a timeout is retried too. Off, only a connection error
            is, which costs no wait: a client whose commands must fail fast still gets a
            fresh connection for one that found its pooled connection dead (a restarted
            server), where a timeout would double the wait.
        max_connections: Connections per Redis node. Past it, on a single node a command
            waits (up to ``socket_timeout_s``) for one to come free; a cluster client
            fails the command. Every fan-out of the index stays far below it
            (:func:`gather_bounded`).
    """

    cluster: bool | None = None
    tls_ca_file: str | None = None
    tls_verify: bool = True
    socket_timeout_s: float = 5.0
    retries: int = 3
    retry_timeouts: bool = True
    max_connections: int = 256


T = TypeVar("T")

FAN_OUT: Final = 32
"""Most commands one index operation keeps in flight at once (far below a pool's size)."""


async def gather_bounded(calls: Iterable[Awaitable[T]], limit: int = FAN_OUT) -> list[T]:
    """Await ``calls`` with at most ``limit`` of them in flight; their results in order.

    The first exception propagates (the calls already started finish unobserved).
    """
    slots = asyncio.Semaphore(limit)

    async def one(call: Awaitable[T]) -> T:
        async with slots:
            return await call

    return await asyncio.gather(*(one(call) for call in calls))


def reply_bytes(value: object) -> bytes:
    """A Redis reply element as bytes (clients here never decode responses).

    Raises:
        RedisConnectError: The element is not bytes (a client with ``decode_responses``).
    """
    if not isinstance(value, bytes):
        raise RedisConnectError(
            f"expected a bytes reply, got {type(value).__name__}: connect with "
            "router.redis_conn.connect(), which keeps replies as bytes"
        )
    return value


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _kwargs(url: str, options: RedisOptions) -> dict[str, Any]:
    scheme = urlsplit(url).scheme
    if scheme not in _SCHEMES:
        raise RedisConnectError(
            f"Redis URL {redact_url(url)!r} must start with redis://, rediss:// or unix://"
        )
    kwargs: dict[str, Any] = {
        "socket_timeout": options.socket_timeout_s,
        "socket_connect_timeout": options.socket_timeout_s,
        "decode_responses": False,
        # A restarted server leaves dead pooled connections: retry on a fresh one.
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.01), options.retries),
        "retry_on_error": [RedisConnectionError]
        + ([RedisTimeoutError] if options.retry_timeouts else []),
    }
    if scheme == "rediss":
        if options.tls_ca_file is not None:
            kwargs["ssl_ca_certs"] = options.tls_ca_file
        if not options.tls_verify:
            kwargs["ssl_cert_reqs"] = "none"
            kwargs["ssl_check_hostname"] = False
    return kwargs


_pack_simple: Final[Callable[[tuple[Any, ...]], bytes | None]] = native_or(
    hiredis.pack_command, "router.store._resp", "pack_command"
)
"""Packs a command of bytes, str and 64-bit ints (kvroute's C module, 10x faster than
hiredis on ints), or declines with None; ``hiredis.pack_command`` where not built."""


class _CPacking:
    """Connection mixin: commands packed in C (same bytes as redis-py's Python packer)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        """One RESP command; a name with spaces (``"CONFIG GET"``) is split as redis-py does.

        Raises:
            DataError: An argument is not str, bytes, int or float.
        """
        name = args[0].encode() if isinstance(args[0], str) else args[0]
        if b" " in name:
            args = (*name.split(), *args[1:])
        try:
            packed = _pack_simple(args)
            return [hiredis.pack_command(args) if packed is None else packed]
        except TypeError as exc:
            raise DataError(f"cannot send {args[0]!r}: {exc}") from None


_pack_args: Final[Callable[[list[Any]], object] | None] = native("router.store._resp", "pack_args")


def arg_packer(client: RedisClient) -> Callable[[list[Any]], object] | None:
    """Where ``client`` packs commands in C: the function that packs a list of ints into
    one argument object its commands send as that many arguments (an index write's keys:
    no list of thousands of ints for redis-py to copy and the collector to walk). None
    where they would reach another packer (a cluster client, one not made by
    :func:`connect`, no C module)."""
    pool = getattr(client, "connection_pool", None)
    cls = getattr(pool, "connection_class", None)
    if _pack_args is None or not (isinstance(cls, type) and issubclass(cls, _CPacking)):
        return None
    return _pack_args


_C_PACKING: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def _c_packing(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    """``cls`` with :class:`_CPacking` (one subclass per connection class)."""
    found = _C_PACKING.get(cls)
    if found is None:
        found = _C_PACKING[cls] = type(f"CPacking{cls.__name__}", (_CPacking, cls), {})
    return found


async def is_cluster(client: aioredis.Redis) -> bool:
    """True when the server runs in cluster mode (``INFO cluster``)."""
    info = await client.info("cluster")
    return bool(int(info.get("cluster_enabled", 0)))


async def connect(url: str, options: RedisOptions | None = None) -> RedisClient:
    """Connect to Redis and check it answers.

    Args:
        url: ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS) or
            ``unix:///path/to/socket``.
        options: Client type, TLS and timeouts.

    Returns:
        A connected single-node or cluster client.

    Raises:
        RedisConnectError: The URL is malformed or the server does not answer.
    """
    options = options or RedisOptions()
    kwargs = _kwargs(url, options)
    try:
        cluster = options.cluster
        if cluster is None:
            probe = aioredis.from_url(url, **kwargs)
            try:
                cluster = await is_cluster(probe)
            finally:
                await probe.aclose()
        client: RedisClient
        if cluster:
            client = RedisCluster.from_url(url, max_connections=options.max_connections, **kwargs)
            await client.initialize()
        else:
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=options.max_connections, timeout=options.socket_timeout_s,
                **kwargs,
            )  # fmt: skip
            pool.connection_class = _c_packing(pool.connection_class)
            client = aioredis.Redis.from_pool(pool)
        await client.ping()
    except (RedisError, OSError, ValueError) as exc:
        raise RedisConnectError(
            f"cannot reach Redis at {redact_url(url)}: {exc}; check the URL, password "
            "and TLS settings and that the server is running"
        ) from exc
    # DEBUG: a process opens several clients; its owner logs the connection once.
    log.debug("connected to Redis %s (%s)", redact_url(url), "cluster" if cluster else "single")
    return client
