"""Redis URLs: password, ``rediss://`` TLS (self-signed cert made here), errors, redaction."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.schema import BlockStored, KVEventBatch
from router.cli.index import main as index_main
from router.index.base import PrefixMatch
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.store.connection import (
    RedisClient,
    RedisConnectError,
    RedisOptions,
    connect,
    redact_url,
)
from router.store.layout import KeyLayout
from router.store.server import RedisServer, RedisServerError, free_port
from router.workers.registry import WorkerRegistry

W = WorkerId("w1")
TOKENS = list(range(8))


async def roundtrip(client: RedisClient, namespace: str = "conn-test") -> None:
    """Write through a lease and look up: the whole index path over this connection."""
    layout = KeyLayout(namespace)
    index = BridgedIndex(RedisPrefixIndex(client, layout))
    lease = await WorkerRegistry(client, layout).acquire(W)
    assert lease is not None
    index.use_lease(W, lease.token)
    event = BlockStored([1, 2], None, TOKENS, 4, None, "GPU", None)
    await index.apply(W, KVEventBatch(1.0, [event]))
    assert await index.lookup(RouterKeyer().keys(TOKENS, 4)) == {W: PrefixMatch(2, 2, 0)}


def test_password_url() -> None:
    with RedisServer(extra_args=["--requirepass", "s3cret"]) as server:

        async def main() -> None:
            client = await connect(f"redis://:s3cret@127.0.0.1:{server.port}/0")
            try:
                await roundtrip(client)
            finally:
                await client.aclose()
            with pytest.raises(RedisConnectError) as info:
                await connect(f"redis://:wrong@127.0.0.1:{server.port}/0")
            assert "wrong" not in str(info.value) and "***" in str(info.value)

        asyncio.run(main())


def test_bad_urls_and_unreachable_servers() -> None:
    async def main() -> None:
        with pytest.raises(RedisConnectError, match="must start with"):
            await connect("http://127.0.0.1:1/0")
        with pytest.raises(RedisConnectError, match="cannot reach Redis"):
            await connect(f"redis://127.0.0.1:{free_port()}/0", RedisOptions(retries=0))

    asyncio.run(main())
    assert redact_url("rediss://user:pw@h:6380/1") == "rediss://user:***@h:6380/1"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.slow
def test_tls_url(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    tls_port = free_port()
    tls_args = [
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(cert),
        "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert),
        "--tls-auth-clients", "no",
        "--requirepass", "s3cret",
    ]  # fmt: skip
    try:
        server = RedisServer(extra_args=tls_args).start()
    except RedisServerError as exc:
        pytest.skip(f"this redis-server has no TLS support: {exc}")
    try:
        url = f"rediss://:s3cret@127.0.0.1:{tls_port}/0"

        async def main() -> None:
            client = await connect(url, RedisOptions(tls_ca_file=str(cert)))
            try:
                await roundtrip(client)
            finally:
                await client.aclose()
            # Without the CA the self-signed certificate is refused.
            with pytest.raises(RedisConnectError):
                await connect(url, RedisOptions(retries=0))

        asyncio.run(main())
        # The CLI speaks TLS too.
        argv = ["stats", "--redis", url, "--namespace", "conn-test", "--tls-ca", str(cert)]
        assert index_main(argv) == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_single_node_writes_send_their_keys_packed_in_c(
    redis_url: str, redis_cluster_url: str, namespace: str
) -> None:
    # A single-node client from connect() packs an index write's key lists in C (one
    # argument object per list); a cluster client, or no C module, takes the ints.
    from events.native import PURE_PYTHON
    from router.store.connection import arg_packer

    native = not PURE_PYTHON and _c_module_built()

    async def main() -> None:
        single = await connect(redis_url)
        cluster = await connect(redis_cluster_url)
        try:
            assert (arg_packer(single) is not None) == native
            assert arg_packer(cluster) is None
            assert RedisPrefixIndex(cluster)._pack is None
            await roundtrip(single, namespace)
        finally:
            await single.aclose()
            await cluster.aclose()

    asyncio.run(main())


def _c_module_built() -> bool:
    try:
        import router.store._resp  # noqa: F401
    except ImportError:
        return False
    return True


def test_a_fail_fast_client_replaces_connections_a_restarted_server_left_dead() -> None:
    """The router's routing reads fail fast (no retry of a timeout), yet a pooled
    connection that a Redis restart left dead is replaced at once instead of failing the
    read (each would have put the router in degraded mode)."""
    fail_fast = RedisOptions(socket_timeout_s=1.0, retries=1, retry_timeouts=False)
    no_retry = RedisOptions(socket_timeout_s=1.0, retries=0)
    port = free_port()

    async def main() -> None:
        server = RedisServer(port=port).start()
        clients = [await connect(server.url, fail_fast), await connect(server.url, no_retry)]
        try:
            for client in clients:
                await client.set(b"k", b"v")  # a pooled connection to this server
            server.stop()
            server = RedisServer(port=port).start()  # same address, new process
            assert await clients[0].get(b"k") is None  # answered: the empty new server
            with pytest.raises(RedisConnectionError):
                await clients[1].get(b"k")  # the dead connection, not replaced
        finally:
            for client in clients:
                await client.aclose()
            server.stop()

    asyncio.run(main())
