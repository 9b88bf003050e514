"""A ``kvroute router`` ingesting CURVE-secured ``kvroute worker`` streams, across processes.

Two workers publish over CURVE and admit only the router's public key (``--curve-allow``).
The router given ``--client-key`` and ``--worker ...,server_key=FILE`` indexes their
blocks and routes a request sharing a cached prefix to the worker that holds it. A second
router (its own namespace) presents a key the workers do not allow: its index stays empty
(``kvroute index stats``), yet it still serves by load.

The workers also guard their snapshots with an admin key that only the allowed router has:
a router whose stream stays quiet resyncs from ``GET /v1/snapshot`` (the idle watchdog,
30 s after its last batch), so with open snapshots the intruder's index would fill over
plain HTTP once the test outlasted that watchdog on a loaded machine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from events.cli.keys import main as keys_main
from events.curve import load_public_key, write_keypair
from router.cluster.runner import ProcessGroup, wait_healthy
from router.errors import PrefixIndexError
from router.store.server import free_port
from router.workers.registry import parse_worker_spec

TIMEOUT_S = 120.0
BLOCK_SIZE = 4
PROMPT = "curve-secured shared prefix, 40 chars!!!"  # 40 bytes: ten 4-token blocks


def kvroute(*args: str) -> list[str]:
    return [sys.executable, "-m", "router", *args]


def index_entries(redis_url: str, namespace: str) -> int:
    """``num_entries`` of ``kvroute index stats`` for a namespace."""
    out = subprocess.run(
        kvroute("index", "stats", "--redis", redis_url, "--namespace", namespace, "--json"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=True,
    )
    return int(json.loads(out.stdout)["num_entries"])


async def post(session: aiohttp.ClientSession, url: str, body: object) -> Any:
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with session.post(url, json=body, timeout=timeout) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def test_index_register_specs_read_the_server_key_file(tmp_path: Path) -> None:
    public, _ = write_keypair(tmp_path, "w0")
    record = parse_worker_spec(f"w0=tcp://127.0.0.1:5557,server_key={public}")
    assert record.server_key == load_public_key(public).decode()
    with pytest.raises(PrefixIndexError, match="cannot read CURVE key file"):
        parse_worker_spec(f"w0=tcp://127.0.0.1:5557,server_key={tmp_path / 'none.key'}")


@pytest.mark.slow
def test_router_with_client_key_indexes_curve_workers_and_an_intruder_routes_by_load(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    pytest.importorskip("torch")
    keys = tmp_path / "keys"
    for name in ("w0", "w1", "router", "intruder"):
        assert keys_main(["--out", str(keys), "--name", name]) == 0
    admin_key = keys / "worker-admin"
    admin_key.write_text("worker-admin-0123456789\n")
    workers = {w: (free_port(), free_port(), free_port()) for w in ("w0", "w1")}
    urls = {w: f"http://127.0.0.1:{http}" for w, (http, _, _) in workers.items()}
    specs = [
        f"{w}={urls[w]},events=tcp://127.0.0.1:{ev},replay=tcp://127.0.0.1:{rp},"
        f"block-size={BLOCK_SIZE},server_key={keys / f'{w}.key'}"
        for w, (_, ev, rp) in workers.items()
    ]
    routers = {"router": (free_port(), "router"), "intruder": (free_port(), "intruder")}
    snapshot_access = {"router": ["--worker-admin-key-file", str(admin_key)], "intruder": []}
    namespaces = {name: f"{namespace}-{name}" for name in routers}
    router_urls = {name: f"http://127.0.0.1:{port}" for name, (port, _) in routers.items()}

    with ProcessGroup(tmp_path / "procs") as group:
        for w, (http, events, replay) in workers.items():
            group.start(
                w,
                kvroute("worker", "--id", w, "--port", str(http),
                        "--events", f"tcp://127.0.0.1:{events}",
                        "--replay", f"tcp://127.0.0.1:{replay}",
                        "--curve-secret-key", str(keys / f"{w}.key_secret"),
                        "--curve-allow", str(keys / "router.key"),
                        "--admin-key-file", str(admin_key),
                        "--num-blocks", "64", "--block-size", str(BLOCK_SIZE),
                        "--num-layers", "1", "--hidden-size", "16", "--num-heads", "2",
                        "--torch-threads", "1"),
            )  # fmt: skip
        worker_flags = [arg for spec in specs for arg in ("--worker", spec)]
        pokes = itertools.count()

        async def poke(session: aiohttp.ClientSession) -> None:
            """A new batch from each worker: a router that missed one replays the gap."""
            for url in urls.values():
                body = {"prompt": f"{next(pokes):04d} poke", "max_tokens": 1}
                await post(session, f"{url}/v1/completions", body)

        async def scenario() -> None:
            async with aiohttp.ClientSession() as session:
                deadline = time.monotonic() + TIMEOUT_S
                for url in urls.values():
                    await wait_healthy(session, url, group, deadline)
                for name, (port, key) in routers.items():
                    group.start(
                        name,
                        kvroute("router", "--redis", redis_url, "--namespace", namespaces[name],
                                "--port", str(port),
                                "--client-key", str(keys / f"{key}.key_secret"),
                                *snapshot_access[name], *worker_flags),
                    )  # fmt: skip
                for url in router_urls.values():
                    await wait_healthy(session, url, group, deadline)
                router = router_urls["router"]
                first = await post(
                    session, f"{router}/v1/completions", {"prompt": PROMPT, "max_tokens": 1}
                )
                assert first["usage"]["prompt_tokens"] == len(PROMPT)
                # The worker's BlockStored events reach the index over CURVE: a request
                # sharing the prefix is then routed to the worker that cached it.
                route: dict[str, Any] = {}
                while route.get("matched_tokens") != len(PROMPT):
                    assert time.monotonic() < deadline, f"index never matched: {route}"
                    group.check_alive()
                    await poke(session)
                    route = await post(
                        session,
                        f"{router}/v1/route",
                        {"prompt": PROMPT + " and a different tail", "dry_run": True},
                    )
                    await asyncio.sleep(0.05)  # polling another process's index writes
                holder = route["worker_id"]
                served = await post(
                    session,
                    f"{router}/v1/completions",
                    {"prompt": PROMPT + " second", "max_tokens": 1},
                )
                assert served["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
                assert route["url"] == urls[holder]
                # The intruder's handshakes fail: no entries, but requests are served.
                intruder = router_urls["intruder"]
                for n in range(4):
                    answer = await post(
                        session,
                        f"{intruder}/v1/completions",
                        {"prompt": f"{PROMPT} intruder {n}", "max_tokens": 1},
                    )
                    assert answer["usage"]["completion_tokens"] == 1

        asyncio.run(scenario())
        deadline = time.monotonic() + TIMEOUT_S
        while "handshake with" not in group.log_tail("intruder", 100_000):
            assert time.monotonic() < deadline, "the intruder logged no failed handshake"
            time.sleep(0.05)  # polling another process's log
        group.check_alive()
        assert index_entries(redis_url, namespaces["router"]) >= len(PROMPT) // BLOCK_SIZE
        assert index_entries(redis_url, namespaces["intruder"]) == 0
