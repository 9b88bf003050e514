"""Real ``kvroute worker`` subprocesses and an in-process router in front of them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from router.front.config import RouterConfig
from router.front.service import RouterService
from router.workers.registry import WorkerRecord
from tests.support.paths import REPO_ROOT as ROOT

BLOCK = 16


BOUND_S = 60.0
"""Longest wait for the cluster to reach a state (a loaded 2-core machine, torch workers)."""


@dataclass
class WorkerProc:
    """A running ``kvroute worker`` subprocess and the endpoints it announced."""

    worker_id: str
    proc: subprocess.Popen[str]
    http: str
    events: str
    replay: str

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.worker_id,
            events_endpoint=self.events,
            replay_endpoint=self.replay,
            http_url=self.http,
            block_size=BLOCK,
        )

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def start_workers(
    ids: list[str], num_blocks: int = 512, args: Mapping[str, Sequence[str]] | None = None
) -> list[WorkerProc]:
    """Start workers in parallel and wait for each one's ready line (stdout JSON).

    Args:
        ids: The workers' ids.
        num_blocks: KV blocks of each.
        args: More flags of some workers, by id.
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "router",
                "worker",
                "--id",
                wid,
                "--port",
                "0",
                "--events",
                "tcp://127.0.0.1:*",
                "--replay",
                "tcp://127.0.0.1:*",
                "--num-blocks",
                str(num_blocks),
                "--block-size",
                str(BLOCK),
                "--torch-threads",
                "1",
                "--log-level",
                "WARNING",
                *(args or {}).get(wid, ()),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for wid in ids
    ]
    workers = []
    for wid, proc in zip(ids, procs, strict=True):
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the worker prints it once listening (or dies)
        if not line:
            for p in procs:
                p.kill()
            raise RuntimeError(f"worker {wid} exited before it was ready")
        ready = json.loads(line)
        workers.append(WorkerProc(wid, proc, ready["http"], ready["events"], ready["replay"]))
    return workers


@asynccontextmanager
async def router(
    redis_url: str, namespace: str, records: list[WorkerRecord], **kw: Any
) -> AsyncIterator[RouterService]:
    config = RouterConfig(redis_url=redis_url, namespace=namespace, port=0, workers=tuple(records))
    service = await RouterService.open(replace(config, **kw))
    try:
        yield service
    finally:
        await service.close()


async def complete(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 4
) -> tuple[str, dict[str, Any]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return resp.headers["X-Kvroute-Worker"], answer["usage"]


async def dry_route(session: aiohttp.ClientSession, url: str, prompt: str) -> dict[str, Any]:
    async with session.post(f"{url}/v1/route", json={"prompt": prompt, "dry_run": True}) as resp:
        assert resp.status == 200
        return await resp.json()  # type: ignore[no-any-return]
