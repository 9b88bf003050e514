"""Redis AUTH and TLS (``rediss://``) against a local TLS-enabled ``redis-server``.

The test makes its own CA and a server certificate for 127.0.0.1 with the openssl CLI,
starts a private ``redis-server`` with ``--requirepass`` and ``--tls-port``, and checks:
the index works end to end through a password-protected TLS URL, from the library and
from ``kvroute index stats``; a wrong password, an unknown CA or plain TCP to the TLS
port fail with a clear error; the password never shows in errors or output.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from events.identity import WorkerId
from events.schema import BlockStored, KVEventBatch
from router.cluster.runner import ProcessGroup, wait_healthy
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.store.connection import RedisConnectError, RedisOptions, connect
from router.store.layout import KeyLayout
from router.store.server import RedisServer, free_port
from router.workers.registry import WorkerRecord, WorkerRegistry

PASSWORD = "s3cret-Pa55word"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


@dataclass(frozen=True)
class TlsRedis:
    tls_port: int
    ca_file: Path
    other_ca_file: Path

    def url(self, password: str = PASSWORD) -> str:
        return f"rediss://:{password}@127.0.0.1:{self.tls_port}/0"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> None:
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "1",
        "-subj", f"/CN=kvroute test {name}",
        cwd=directory,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    d = tmp_path_factory.mktemp("tls")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1",
        cwd=d,
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "san.ext",
        cwd=d,
    )  # fmt: skip
    tls_port = free_port()
    server = RedisServer(
        extra_args=[
            "--requirepass", PASSWORD,
            "--tls-port", str(tls_port),
            "--tls-cert-file", str(d / "server.crt"),
            "--tls-key-file", str(d / "server.key"),
            "--tls-ca-cert-file", str(d / "ca.crt"),
            "--tls-auth-clients", "no",
        ]
    )  # fmt: skip
    with server:
        yield TlsRedis(tls_port, d / "ca.crt", d / "other-ca.crt")


def stored(block_hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=list(block_hashes),
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_index_round_trip_over_tls_with_auth(tls_redis: TlsRedis, namespace: str) -> None:
    async def scenario() -> None:
        client = await connect(tls_redis.url(), RedisOptions(tls_ca_file=str(tls_redis.ca_file)))
        try:
            layout = KeyLayout(namespace)
            registry = WorkerRegistry(client, layout, lease_ttl_ms=30_000)
            await registry.register(WorkerRecord(worker_id="w0", events_endpoint="tcp://x:1"))
            lease = await registry.acquire(WorkerId("w0"))
            assert lease is not None
            index = BridgedIndex(RedisPrefixIndex(client, layout))
            index.use_lease(WorkerId("w0"), lease.token)
            tokens = list(range(8))
            batch = KVEventBatch(ts=1.0, events=[stored([11, 12], None, tokens)])
            await index.apply(WorkerId("w0"), batch)
            keys = index.keyer.keys(tokens, 4)
            match = (await index.lookup(keys))[WorkerId("w0")]
            assert (match.num_blocks, match.num_gpu_blocks) == (2, 2)
            assert [r.worker_id for r in await registry.records()] == ["w0"]
        finally:
            await client.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong_password", "invalid username-password pair"),
        ("unknown_ca", "certificate verify failed"),
        ("plain_to_tls_port", "cannot reach Redis"),
    ],
)
def test_bad_credentials_fail_clearly_without_leaking_the_password(
    tls_redis: TlsRedis, case: str, expected: str
) -> None:
    ca = str(tls_redis.ca_file)
    url, options = {
        "wrong_password": (tls_redis.url("not-the-password"), RedisOptions(tls_ca_file=ca)),
        "unknown_ca": (tls_redis.url(), RedisOptions(tls_ca_file=str(tls_redis.other_ca_file))),
        "plain_to_tls_port": (
            f"redis://:{PASSWORD}@127.0.0.1:{tls_redis.tls_port}/0",
            RedisOptions(socket_timeout_s=2.0),
        ),
    }[case]

    async def scenario() -> str:
        with pytest.raises(RedisConnectError) as info:
            await connect(url, options)
        return str(info.value)

    message = asyncio.run(scenario())
    assert expected in message
    assert "cannot reach Redis at rediss://:***@" in message or ":***@127.0.0.1" in message
    assert PASSWORD not in message and "not-the-password" not in message


def test_no_password_is_refused(tls_redis: TlsRedis) -> None:
    async def scenario() -> str:
        with pytest.raises(RedisConnectError) as info:
            url = f"rediss://127.0.0.1:{tls_redis.tls_port}/0"
            await connect(url, RedisOptions(tls_ca_file=str(tls_redis.ca_file)))
        return str(info.value)

    assert "authenticated" in asyncio.run(scenario())


@pytest.mark.slow
def test_index_stats_cli_over_tls_with_auth(tls_redis: TlsRedis, namespace: str) -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "router", "index", "stats",
            "--redis", tls_redis.url(),
            "--tls-ca", str(tls_redis.ca_file),
            "--namespace", namespace,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert (stats["num_entries"], stats["num_keys"], stats["num_workers"]) == (0, 0, 0)
    assert stats["memory_bytes"] > 0
    assert PASSWORD not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_index_stats_cli_with_a_wrong_password_exits_2_and_redacts(tls_redis: TlsRedis) -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "router", "index", "stats",
            "--redis", tls_redis.url("wrong-one"),
            "--tls-ca", str(tls_redis.ca_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "invalid username-password pair" in proc.stderr
    assert "wrong-one" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_router_over_tls_with_auth(tls_redis: TlsRedis, namespace: str, tmp_path: Path) -> None:
    """``kvroute router --redis rediss://:PASSWORD@...?ssl_ca_certs=CA``: live index, no leak.

    The router has no ``--tls-ca`` flag; redis-py passes the URL's ``ssl_ca_certs`` query
    argument to the TLS connection.
    """
    port = free_port()
    url = f"{tls_redis.url()}?ssl_ca_certs={tls_redis.ca_file}"
    argv = [sys.executable, "-m", "router", "router", "--redis", url,
            "--namespace", namespace, "--port", str(port)]  # fmt: skip
    with ProcessGroup(tmp_path) as group:
        group.start("router", argv)

        async def health() -> dict[str, object]:
            async with aiohttp.ClientSession() as session:
                router = f"http://127.0.0.1:{port}"
                await wait_healthy(session, router, group, time.monotonic() + 120)
                async with session.get(f"{router}/health") as response:
                    body: dict[str, object] = await response.json()
                    return body

        assert asyncio.run(health())["index"] == "live"
        log = group.log_tail("router", 100_000)
    assert f"rediss://:***@127.0.0.1:{tls_redis.tls_port}/0" in log
    assert PASSWORD not in log
