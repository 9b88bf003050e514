"""A fleet of lightweight workers in one helper process: real PUB sockets and HTTP ports.

Shared by the fleet-scale tests and ``benchmarks/bench_fleet.py``. ``python -m
tests.support.fleet N`` binds N ZeroMQ PUB sockets and N HTTP ports on loopback (one of
each per worker, no model, no pool), prints one JSON line (the workers' ``POST
/v1/workers`` bodies), then serves ``GET /health`` (idle load, a lifetime id per worker)
``GET /v1/snapshot`` (nothing cached: what it published is not kept) and ``GET
/v1/models`` on every port and reads commands on stdin:

* ``publish I P``: worker ``I`` publishes one batch storing prompt ``P``'s blocks (seq
  numbered per worker, from 0);
* ``quit``.

:class:`Fleet` starts it and talks to it from a test or a benchmark; :func:`register`
registers its workers with a router.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import IO, Any, Final

import aiohttp
import zmq
from aiohttp import web

from events.framing import make_message, send_frames
from events.schema import KVEventBatch, encode_batch
from tests.support.ingest import BS, stored

HOST: Final = "127.0.0.1"
MODEL: Final = "fleet-model"
REPO: Final = Path(__file__).resolve().parents[2]
BLOCKS: Final = 4
"""Blocks of each published prompt."""


def fleet_batch(prompt: int) -> bytes:
    """The payload a fleet worker publishes for ``prompt``: its first :data:`BLOCKS`."""
    return encode_batch(KVEventBatch(ts=0.0, events=[stored(prompt, 0, BLOCKS)]))


class _Publishers:
    """One PUB socket per worker (used only by the thread that reads stdin)."""

    def __init__(self, num_workers: int) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, num_workers + 64)
        self.sockets: list[zmq.Socket[bytes]] = []
        self.seqs = [0] * num_workers
        for _ in range(num_workers):
            sock = self.context.socket(zmq.PUB)
            sock.linger = 0
            sock.bind(f"tcp://{HOST}:*")
            self.sockets.append(sock)

    def endpoint(self, index: int) -> str:
        return str(self.sockets[index].getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, index: int, prompt: int) -> None:
        seq = self.seqs[index]
        self.seqs[index] = seq + 1
        send_frames(self.sockets[index], make_message(b"", seq, fleet_batch(prompt)))

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()


async def _serve(num_workers: int) -> None:
    publishers = _Publishers(num_workers)
    lifetimes = [uuid.uuid4().hex for _ in range(num_workers)]
    by_port: dict[int, int] = {}

    def index_of(request: web.Request) -> int:
        assert request.transport is not None
        return by_port[request.transport.get_extra_info("sockname")[1]]

    async def health(request: web.Request) -> web.Response:
        lifetime = lifetimes[index_of(request)]
        return web.json_response(
            {"status": "ok", "lifetime_id": lifetime, "running": 0, "waiting": 0}
        )

    async def snapshot(request: web.Request) -> web.Response:
        index = index_of(request)
        body = {"block_size": BS, "runs": [], "next_seq": publishers.seqs[index],
                "lifetime_id": lifetimes[index]}  # fmt: skip
        return web.json_response(body)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/snapshot", snapshot)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    bodies: list[dict[str, Any]] = []
    for i in range(num_workers):
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        port = int(runner.addresses[-1][1])
        by_port[port] = i
        bodies.append(
            {"worker_id": f"f{i}", "url": f"http://{HOST}:{port}",
             "events": publishers.endpoint(i), "block_size": BS, "models": [MODEL]}
        )  # fmt: skip
    print(json.dumps(bodies), flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def read_commands() -> None:
        for line in sys.stdin:
            words = line.split()
            if words[:1] == ["publish"]:
                publishers.publish(int(words[1]), int(words[2]))
            elif words[:1] == ["quit"]:
                break
        loop.call_soon_threadsafe(done.set)

    reader = threading.Thread(target=read_commands, daemon=True)
    reader.start()
    await done.wait()
    reader.join()
    publishers.close()
    await runner.cleanup()


async def register(url: str, bodies: list[dict[str, Any]]) -> list[int]:
    """``POST /v1/workers`` every body to the router at ``url`` (8 at a time); the
    statuses, in order."""
    slots = asyncio.Semaphore(8)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one(body: dict[str, Any]) -> int:
            async with slots, session.post(f"{url}/v1/workers", json=body) as resp:
                await resp.read()
                return resp.status

        return await asyncio.gather(*(one(b) for b in bodies))


class Fleet:
    """The helper process of ``num_workers`` workers; use as a context manager.

    Attributes:
        bodies: Each worker's ``POST /v1/workers`` body (ids ``f0 .. f{n-1}``).
    """

    def __init__(self, num_workers: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fleet", str(num_workers)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
        )  # fmt: skip
        assert self._proc.stdout is not None and self._proc.stdin is not None
        self._stdin: IO[str] = self._proc.stdin
        line = self._proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"the fleet helper exited ({self._proc.wait()}) before its list")
        self.bodies: list[dict[str, Any]] = json.loads(line)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def publish(self, index: int, prompt: int) -> None:
        """Worker ``index`` publishes prompt ``prompt``'s blocks (one batch)."""
        self._stdin.write(f"publish {index} {prompt}\n")
        self._stdin.flush()

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._stdin.write("quit\n")
                self._stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1])))
