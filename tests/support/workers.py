"""kvroute workers running in the test process, on real loopback HTTP and ZeroMQ sockets.

:func:`start_worker` runs ``pool.worker.cli.serve`` on its own thread and event loop and
returns once the worker reports its addresses; :meth:`RunningWorker.stop` drains it.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from pool.worker.cli import serve
from pool.worker.config import WorkerConfig

BLOCK_SIZE = 4
TIMEOUT_S = 60.0
JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass
class RunningWorker:
    """A worker serving on its own thread; its URL and event endpoints."""

    http: str
    events: str
    replay: str
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    stop_event: asyncio.Event

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive()


def start_worker(config: WorkerConfig) -> RunningWorker:
    """Serve ``config`` on a new thread; returns once the worker is up (or raises its error)."""
    ready: queue.Queue[dict[str, Any] | BaseException] = queue.Queue()
    loop = asyncio.new_event_loop()
    holder: list[asyncio.Event] = []

    async def main() -> None:
        holder.append(asyncio.Event())
        await serve(config, holder[0], ready.put)

    def run() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as exc:
            ready.put(exc)
        finally:
            loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    info = ready.get(timeout=TIMEOUT_S)
    assert isinstance(info, dict), info
    return RunningWorker(info["http"], info["events"], info["replay"], thread, loop, holder[0])


def worker_config(num_blocks: int, **overrides: Any) -> WorkerConfig:
    """Worker ``w-test`` on free loopback ports, 4-token blocks, seed 5; ``overrides`` win."""
    base = {
        "worker_id": "w-test",
        "port": 0,
        "events": "tcp://127.0.0.1:*",
        "replay": "tcp://127.0.0.1:*",
        "topic": "kv",
        "num_blocks": num_blocks,
        "block_size": BLOCK_SIZE,
        "seed": 5,
    }
    base.update(overrides)
    return WorkerConfig(**base)


def post_json(url: str, body: object, raw: bytes | None = None) -> tuple[int, Any]:
    """POST ``body`` as JSON (or the bytes ``raw``); returns the status and the JSON answer."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers=JSON_HEADERS)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get_body(url: str) -> tuple[int, bytes]:
    """GET ``url``; returns the status and the body, for errors too."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
