"""Debugging by replay: record two workers' KV events, then rebuild the index and explain.

1. Start two kvroute workers and ``kvroute record`` subscribed to both.
2. Send a few prompts straight to the workers (w0 gets a shared system prompt, w1 a
   document), note the moment, then reset w0's prefix cache (an ``AllBlocksCleared``).
3. ``kvroute replay`` the log at that moment and at the end, and ``kvroute explain``
   where a new prompt with the system prompt would go at each: to w0 before the reset,
   anywhere after it.

    python examples/replay_debugging.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from events.recorder import read_log
from router.cli import main as kvroute
from router.cluster import ProcessGroup, wait_healthy
from router.redis_server import free_port

SYSTEM = "You are a careful assistant for the kvroute project. Answer briefly. " * 3
DOCUMENT = "Chapter one. The cache remembered every prefix it had ever computed. " * 3
PYTHON = [sys.executable, "-m", "router"]


async def complete(session: aiohttp.ClientSession, url: str, prompt: str) -> int:
    """Send one completion; returns the prompt tokens the worker found cached."""
    body = {"prompt": prompt, "max_tokens": 2}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        return int((await resp.json())["usage"]["cached_tokens"])


async def published(session: aiohttp.ClientSession, url: str) -> int:
    """Event batches a worker has published (from its Prometheus metrics)."""
    async with session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("kvroute_worker_event_batches_published_total"):
                return int(float(line.split()[-1]))
    return 0


def last_seqs_in_log(log: Path) -> dict[str, int]:
    """The seq of each worker's last batch in the log so far."""
    last: dict[str, int] = {}
    if log.exists() and log.stat().st_size > 0:
        for record in read_log(log):
            if record.kind == "batch" and record.seq is not None:
                last[record.worker_id] = record.seq
    return last


async def until_recorded(
    session: aiohttp.ClientSession, urls: dict[str, str], log: Path, timeout_s: float = 60.0
) -> None:
    """Wait until the log holds the last batch each worker published (seq = count - 1)."""
    deadline = time.monotonic() + timeout_s
    while True:
        wanted = {w: await published(session, url) - 1 for w, url in urls.items()}
        have = last_seqs_in_log(log)
        if all(have.get(w, -1) >= seq for w, seq in wanted.items()):
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
        while worker not in last_seqs_in_log(log):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the recorder never received {worker}'s events")
            async with session.post(f"{url}/v1/reset_prefix_cache") as resp:
                resp.raise_for_status()
            await asyncio.sleep(0.2)  # give the probe time to land before the next one


async def drive(urls: dict[str, str], group: ProcessGroup, log: Path) -> float:
    """Run the scenario; returns the moment between the requests and w0's reset."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        deadline = time.monotonic() + 120
        await asyncio.gather(*(wait_healthy(session, u, group, deadline) for u in urls.values()))
        await subscribed(session, urls, log)
        await complete(session, urls["w0"], SYSTEM + "Question: what is a block?")
        await complete(session, urls["w1"], DOCUMENT + "Summarise.")
        cached = await complete(session, urls["w0"], SYSTEM + "Question: what is a seq?")
        print(f"w0 served the second question with {cached} cached prompt tokens")
        await until_recorded(session, urls, log)
        moment = time.time()
        async with session.post(f"{urls['w0']}/v1/reset_prefix_cache") as resp:
            resp.raise_for_status()
        await until_recorded(session, urls, log)
        return moment


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="directory for the log (default: temporary)")
    args = parser.parse_args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="kvroute-replay-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "events.kvlog"
    urls: dict[str, str] = {}
    with ProcessGroup(workdir / "logs") as group:
        specs = []
        for worker in ("w0", "w1"):
            http, events, replay = free_port(), free_port(), free_port()
            urls[worker] = f"http://127.0.0.1:{http}"
            group.start(
                worker,
                [*PYTHON, "worker", "--id", worker, "--port", str(http), "--num-blocks", "128",
                 "--events", f"tcp://127.0.0.1:{events}",
                 "--replay", f"tcp://127.0.0.1:{replay}"],
            )  # fmt: skip
            specs += [
                "--worker",
                f"{worker}=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay}",
            ]
        group.start("record", [*PYTHON, "record", *specs, "--out", str(log),
                               "--flush-interval-s", "0.1"])  # fmt: skip
        moment = asyncio.run(drive(urls, group, log))
    question = SYSTEM + "Question: what is an epoch?"
    for at in (str(moment), "end"):
        print(f"\n$ kvroute replay {log} --at {at}")
        if kvroute(["replay", str(log), "--at", at]) != 0:
            return 1
        print(f"\n$ kvroute explain {log} --at {at} --prompt '<system prompt> + question'")
        if kvroute(["explain", str(log), "--at", at, "--prompt", question]) != 0:
            return 1
    print(f"\nevent log kept in {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
