"""Attack surface: every listening socket is on loopback by default; no pickle anywhere.

* A running ``kvroute worker`` (HTTP, event PUB, replay ROUTER), a ``kvroute router``
  and the embedded ``redis-server`` listen only on 127.0.0.1, checked from the kernel's
  socket table (psutil), with only ports given on the command line.
* The defaults of every command and config that binds say 127.0.0.1.
* No module of the project imports or calls a pickle-based loader (``pickle``,
  ``cPickle``, ``dill``, ``cloudpickle``, ``shelve``, ``marshal``, ``torch.load``,
  ``numpy.load(allow_pickle=True)``), and the bytes a worker puts on the wire and a
  recorder writes to its log are msgpack, never pickle.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import psutil
import pytest
import zmq

from events.framing import parse_message
from events.publisher import PublisherConfig
from events.recorder import LOG_MAGIC
from router.cluster.runner import ProcessGroup, wait_healthy
from router.store.server import RedisServer, free_port
from tests.support.paths import REPO_ROOT as REPO

SOURCE_DIRS = ("pool", "events", "router", "benchmarks", "examples")
TIMEOUT_S = 60.0
PICKLE_USE = re.compile(
    r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill|cloudpickle|shelve|marshal)\b"
    r"|\btorch\.load\s*\("
    r"|allow_pickle\s*=\s*True"
    r"|\bpickle\.(loads?|dumps?)\b",
    re.MULTILINE,
)


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """The (ip, port) pairs process ``pid`` listens on (TCP)."""
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def assert_loopback(addresses: set[tuple[str, int]]) -> None:
    assert addresses, "the process listens on nothing"
    for ip, port in addresses:
        assert ipaddress.ip_address(ip).is_loopback, f"listening on {ip}:{port}"


@pytest.fixture(scope="module")
def running_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int, int, int]]:
    """A worker with only its ports given; yields (pid, http, events, replay) ports."""
    http, events, replay = free_port(), free_port(), free_port()
    argv = [
        sys.executable, "-m", "router", "worker",
        "--port", str(http),
        "--events", f"tcp://127.0.0.1:{events}",
        "--replay", f"tcp://127.0.0.1:{replay}",
        "--num-blocks", "32", "--block-size", "4",
        "--num-layers", "1", "--hidden-size", "16", "--num-heads", "2",
    ]  # fmt: skip
    with ProcessGroup(tmp_path_factory.mktemp("surface")) as group:
        proc = group.start("worker", argv)

        async def ready() -> None:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{http}"
                await wait_healthy(session, url, group, time.monotonic() + 120)

        asyncio.run(ready())
        yield proc.pid, http, events, replay


@pytest.mark.slow
def test_worker_listens_on_loopback_only(running_worker: tuple[int, int, int, int]) -> None:
    pid, http, events, replay = running_worker
    addresses = listening_addresses(pid)
    assert_loopback(addresses)
    assert {port for _, port in addresses} == {http, events, replay}


@pytest.mark.slow
def test_router_and_its_embedded_redis_listen_on_loopback_only(tmp_path: Path) -> None:
    """``kvroute router`` with only ``--port`` (no ``--redis``: it starts its own)."""
    port = free_port()
    with ProcessGroup(tmp_path) as group:
        proc = group.start(
            "router", [sys.executable, "-m", "router", "router", "--port", str(port)]
        )

        async def ready() -> None:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}"
                await wait_healthy(session, url, group, time.monotonic() + 120)

        asyncio.run(ready())
        router = listening_addresses(proc.pid)
        assert_loopback(router)
        assert port in {p for _, p in router}
        children = psutil.Process(proc.pid).children(recursive=True)
        assert [c.name() for c in children] == ["redis-server"]
        assert_loopback(listening_addresses(children[0].pid))


def test_embedded_redis_listens_on_loopback_only() -> None:
    with RedisServer() as server:
        assert server.is_running
        pids = [
            p.pid
            for p in psutil.Process().children(recursive=True)
            if server.port in {port for _, port in listening_addresses(p.pid)}
        ]
        assert len(pids) == 1
        assert_loopback(listening_addresses(pids[0]))


def test_binding_defaults_are_loopback() -> None:
    pytest.importorskip("torch")
    from pool.worker.config import WorkerConfig
    from pool.worker.flags import build_parser

    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1" == WorkerConfig().host
    assert args.events.startswith("tcp://127.0.0.1:")
    assert PublisherConfig().endpoint.address.startswith("tcp://127.0.0.1:")
    assert RedisServer().host == "127.0.0.1"


def test_no_pickle_in_the_source_tree() -> None:
    offenders = []
    for directory in SOURCE_DIRS:
        for path in sorted((REPO / directory).rglob("*.py")):
            for match in PICKLE_USE.finditer(path.read_text()):
                line = path.read_text().count("\n", 0, match.start()) + 1
                offenders.append(f"{path.relative_to(REPO)}:{line}: {match.group(0).strip()}")
    assert offenders == []


def test_the_pattern_catches_pickle() -> None:
    for text in ("import pickle", "from cloudpickle import dumps", "x = torch.load(f)",
                 "np.load(f, allow_pickle=True)", "    import marshal"):  # fmt: skip
        assert PICKLE_USE.search(text), text
    assert not PICKLE_USE.search("safetensors.torch.load_file(path)")


def pickle_header(data: bytes) -> bool:
    """True when ``data`` starts like a pickle (PROTO opcode 0x80, protocol 2..5)."""
    return len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5


@pytest.mark.slow
def test_wire_and_event_log_are_msgpack(
    running_worker: tuple[int, int, int, int], tmp_path: Path
) -> None:
    """What a worker publishes and what ``kvroute record`` writes decode as msgpack."""
    _, http, events, replay = running_worker
    log_path = tmp_path / "events.kvlog"
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.linger = 0
    sub.subscribe(b"")
    sub.connect(f"tcp://127.0.0.1:{events}")
    record_argv = [
        sys.executable, "-m", "router", "record",
        "--worker", f"w=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay}",
        "--out", str(log_path), "--flush-interval-s", "0.1",
    ]  # fmt: skip
    frames: list[list[bytes]] = []
    try:
        with ProcessGroup(tmp_path / "logs") as group:
            group.start("record", record_argv)

            def logged() -> bool:
                return log_path.exists() and log_path.stat().st_size > len(LOG_MAGIC) + 64

            async def drive() -> None:
                # Distinct prompts until both our SUB and the recorder have seen events.
                deadline = time.monotonic() + TIMEOUT_S
                n = 0
                async with aiohttp.ClientSession() as session:
                    while not frames or not logged():
                        assert time.monotonic() < deadline, "no events seen"
                        group.check_alive()
                        body = {"prompt": f"probe {n} " * 3, "max_tokens": 1}
                        n += 1
                        url = f"http://127.0.0.1:{http}/v1/completions"
                        async with session.post(url, json=body) as response:
                            assert response.status == 200
                        while sub.poll(100):
                            frames.append(sub.recv_multipart())

            asyncio.run(drive())
    finally:
        context.destroy(linger=0)
    for message in frames:
        _, _, payload = parse_message(message)
        assert not pickle_header(bytes(payload))
        msgspec.msgpack.decode(payload)  # raises if not msgpack
    data = log_path.read_bytes()
    assert data.startswith(LOG_MAGIC)
    assert b"\x80\x04\x95" not in data and b"\x80\x05\x95" not in data  # pickle 4/5 frames
