"""Debugging by replay: record two workers' KV events, then rebuild the index and explain.

1. Start two kvroute workers, ``kvroute record`` subscribed to both, and a router in front
   of them that writes a decision log (it starts its own embedded Redis).
2. Send three prompts through the router: a question after a shared system prompt, a
   document, a second question after the same system prompt (it follows the first), the
   last once the router's view has caught up with the first two (see :func:`settled`).
   Note the moment, then reset the prefix cache of the worker holding the system prompt.
3. ``kvroute replay`` the log at that moment and at the end; ``kvroute explain`` why the
   second question went where it did (the replayed state agrees with the router's
   decision record), and what changed after the reset: the index holds nothing of the
   system prompt any more, but the router's predicted entry for that decision (in its
   record) still credits the holder with it, so the router would still send it there.

    python examples/replay_debugging.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp

from events.identity import WorkerId
from events.recorder import last_batch_seqs
from router.cli.main import main as kvroute
from router.cluster.processes import ProcessGroup, log_directory, wait_healthy
from router.store.server import free_port

SYSTEM = "You are a careful assistant for the kvroute project. Answer briefly. " * 3
DOCUMENT = "Chapter one. The cache remembered every prefix it had ever computed. " * 3
SECOND = SYSTEM + "Question: what is a seq?"
PYTHON = [sys.executable, "-m", "router"]


async def complete(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[str, int]:
    """Send one completion through the router; returns its worker and cached prompt tokens."""
    body = {"prompt": prompt, "max_tokens": 2}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        cached = int((await resp.json())["usage"]["cached_tokens"])
        return resp.headers["X-Kvroute-Worker"], cached


async def published(session: aiohttp.ClientSession, url: str) -> int:
    """Event batches a worker has published (from its Prometheus metrics)."""
    async with session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("kvroute_worker_event_batches_published_total"):
                return int(float(line.split()[-1]))
    return 0


async def until_recorded(
    session: aiohttp.ClientSession, urls: dict[str, str], log: Path, timeout_s: float = 60.0
) -> None:
    """Wait until the log holds the last batch each worker published (seq = count - 1)."""
    deadline = time.monotonic() + timeout_s
    while True:
        wanted = {w: await published(session, url) - 1 for w, url in urls.items()}
        have = last_batch_seqs(log)
        if all(have.get(WorkerId(w), -1) >= seq for w, seq in wanted.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"recorder has {have}, workers published {wanted}")
        await asyncio.sleep(0.1)  # the recorder flushes every 0.1 s; poll the file


async def subscribed(
    session: aiohttp.ClientSession, urls: dict[str, str], log: Path, timeout_s: float = 60.0
) -> None:
    """Handshake: reset each (empty) cache until the recorder has logged one of its events.

    A subscriber that connects late misses what was sent before, so probes are published
    until one is seen, instead of hoping a sleep was long enough.
    """
    deadline = time.monotonic() + timeout_s
    for worker, url in urls.items():
        while worker not in last_batch_seqs(log):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the recorder never received {worker}'s events")
            async with session.post(f"{url}/v1/reset_prefix_cache") as resp:
                resp.raise_for_status()
            await asyncio.sleep(0.2)  # give the probe time to land before the next one


async def settled(
    session: aiohttp.ClientSession, router: str, holder: str, prompt: str, timeout_s: float = 60.0
) -> None:
    """Wait until the router's view has caught up with the requests that finished.

    Its index must confirm the prefix of ``prompt`` it predicted ``holder`` caches (the
    worker's events reach the index a moment after its answer), and no worker may show
    load (workers' own load reports are polled: one read mid-request lingers until the
    next poll). Routing ``prompt`` earlier would record a decision that a replay of the
    event log does not reproduce, for reasons of timing alone.
    """
    deadline = time.monotonic() + timeout_s
    body = {"prompt": prompt, "dry_run": True}
    while True:
        async with session.post(f"{router}/v1/route", json=body) as resp:
            resp.raise_for_status()
            candidates = (await resp.json())["candidates"]
        confirmed = any(
            c["worker_id"] == holder and 0 < c["matched_tokens"] == c["predicted_tokens"]
            for c in candidates
        )
        if confirmed and not any(any(c["load"].values()) for c in candidates):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router's view never caught up: {candidates}")
        await asyncio.sleep(0.1)  # the router ingests and polls loads in the background


async def drive(urls: dict[str, str], router: str, group: ProcessGroup, log: Path) -> float:
    """Run the scenario; returns the moment between the requests and the cache reset."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        deadline = time.monotonic() + 120
        await asyncio.gather(
            *(wait_healthy(session, u, group, deadline) for u in [*urls.values(), router])
        )
        await subscribed(session, urls, log)
        holder, _ = await complete(session, router, SYSTEM + "Question: what is a block?")
        await complete(session, router, DOCUMENT + "Summarise.")
        await settled(session, router, holder, SECOND)
        again, cached = await complete(session, router, SECOND)
        print(f"the second question went to {again} ({cached} cached prompt tokens); the "
              f"first went to {holder}")  # fmt: skip
        await until_recorded(session, urls, log)
        moment = time.time()
        async with session.post(f"{urls[holder]}/v1/reset_prefix_cache") as resp:
            resp.raise_for_status()
        await until_recorded(session, urls, log)
        return moment


def _each(flag: str, values: list[str]) -> list[str]:
    return [item for value in values for item in (flag, value)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--keep",
        type=Path,
        help="directory for the event log and process logs, kept (default: a temporary one, "
        "removed at the end unless the example fails)",
    )
    args = parser.parse_args(argv)
    with log_directory(args.keep, prefix="kvroute-replay-") as workdir:
        code = run(workdir.path)
        if code and workdir.is_temporary:
            workdir.keep()
            print(f"\nfiles kept in {workdir.path}", file=sys.stderr)
        elif not workdir.is_temporary:
            print(f"\nevent log kept in {workdir.path / 'events.kvlog'}")
        return code


def run(workdir: Path) -> int:
    """Run the whole loop with its files in ``workdir``; returns the exit code."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "events.kvlog"
    decisions = workdir / "decisions.jsonl"
    urls: dict[str, str] = {}
    router_port = free_port()
    router = f"http://127.0.0.1:{router_port}"
    with ProcessGroup(workdir / "logs") as group:
        specs: list[str] = []
        routes: list[str] = []
        for worker in ("w0", "w1"):
            http, events, replay = free_port(), free_port(), free_port()
            urls[worker] = f"http://127.0.0.1:{http}"
            group.start(
                worker,
                [*PYTHON, "worker", "--id", worker, "--port", str(http), "--num-blocks", "128",
                 "--events", f"tcp://127.0.0.1:{events}",
                 "--replay", f"tcp://127.0.0.1:{replay}"],
            )  # fmt: skip
            streams = f"events=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay}"
            specs.append(f"{worker}=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay}")
            routes.append(f"{worker}={urls[worker]},{streams}")
        group.start("record", [*PYTHON, "record", *_each("--worker", specs), "--out", str(log),
                               "--flush-interval-s", "0.1"])  # fmt: skip
        group.start("router", [*PYTHON, "router", "--port", str(router_port),
                               "--decision-log", str(decisions),
                               *_each("--worker", routes)])  # fmt: skip
        moment = asyncio.run(drive(urls, router, group, log))
    for at in (str(moment), "end"):
        print(f"\n$ kvroute replay {log} --at {at}")
        if kvroute(["replay", str(log), "--at", at]) != 0:
            return 1
        print(f"\n$ kvroute explain {log} --at {at} --prompt '<the second question>' "
              f"--decisions {decisions}")  # fmt: skip
        explain = ["explain", str(log), "--at", at, "--prompt", SECOND]
        if kvroute([*explain, "--decisions", str(decisions)]) != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
