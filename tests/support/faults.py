"""A cluster of real processes to break: processes to kill, a synthetic worker, checks, load.

Shared by the fault and integration tests.

* :class:`Cluster`: a private Redis, kvroute workers and routers as real processes on
  fixed loopback ports, each one killable (SIGKILL), freezable (SIGSTOP) and restartable
  in place.
* :class:`SyntheticWorker`: a worker without a model, in the test process: a real
  ``KVCacheManager`` + ``EventPublisher`` (loss injection, small high-water marks) and the
  worker's ``/health`` and ``/v1/snapshot`` over HTTP (with its publisher lifetime id), so
  a real router ingests it exactly as a kvroute worker and ``kvroute index check`` can
  compare against it.
* :func:`index_check`: runs ``kvroute index check --json`` and returns the divergence.
* :func:`scrape`: a router's ``/metrics`` as ``{(name, labels): value}``.
* :class:`Load`: closed-loop clients whose every request ends in an answer, a JSON
  error or a connection error (a hang fails the test).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from events.endpoints import Endpoint
from events.publisher import EventPublisher, PublisherConfig
from events.schema import KVEventBatch
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.snapshot import CachedChains, new_lifetime_id
from router.cluster.runner import ProcessGroup, wait_healthy
from router.store.server import RedisServer, free_port
from tests.support.polling import wait_until

HOST = "127.0.0.1"
BLOCK_SIZE = 4
NUM_BLOCKS = 64
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 60.0
"""A request not answered within this is a hang (the test fails)."""
WORKER_ARGS = ("--num-layers", "1", "--hidden-size", "16", "--num-heads", "2")
REDIS = "redis"
"""The name of the cluster's Redis (for :meth:`Cluster.address`)."""
CLIENT = "client"
"""The name of where the test's clients run (for :meth:`Cluster.place`)."""
T = TypeVar("T")


def python_m(*args: str) -> list[str]:
    return [sys.executable, "-m", "router", *args]


@dataclass(frozen=True)
class WorkerPorts:
    """A worker's ports on its ``host`` address (loopback unless it runs elsewhere)."""

    worker_id: str
    http: int = field(default_factory=free_port)
    events: int = field(default_factory=free_port)
    replay: int = field(default_factory=free_port)
    host: str = HOST

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.events}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay}"

    def spec(self, replay: str | None = None) -> str:
        """The router's ``--worker`` flag for this worker."""
        replay = replay or self.replay_endpoint
        return (
            f"{self.worker_id}={self.url},events={self.events_endpoint},replay={replay},"
            f"block-size={BLOCK_SIZE}"
        )


class Cluster:
    """Private Redis, workers and routers as processes; use as a context manager.

    Redis listens on a port fixed for the cluster's life, so a restarted Redis is found
    at the same URL.

    Every process runs on loopback here; :meth:`address`, :meth:`place` and :meth:`call`
    say where each process (by name) listens, how its command line runs there, and where
    the test's own requests run, so a subclass can spread the cluster over hosts
    (``tests.support.multihost``). The workers' ports are chosen on entering.

    Args:
        log_dir: Where each process logs.
        num_workers: kvroute workers ``w0 .. w{n-1}``.
    """

    def __init__(self, log_dir: Path, num_workers: int = 2) -> None:
        self.group = ProcessGroup(log_dir, stop_timeout_s=5.0)
        self.redis_port = free_port()
        self.redis: RedisServer | None = None
        self.namespace = f"faults-{random.getrandbits(32):08x}"
        self.num_workers = num_workers
        self.workers: list[WorkerPorts] = []
        self.routers: dict[str, int] = {}
        self.check_args: list[str] = []
        """More flags for every ``kvroute index check`` of the cluster (a workers' key)."""

    def address(self, name: str) -> str:
        """The address process ``name`` listens on."""
        return HOST

    def place(self, name: str, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` where process ``name`` lives."""
        return argv

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` where the test's clients live (requests, probes, checks)."""
        return fn(*args)

    @property
    def redis_url(self) -> str:
        return f"redis://{self.address(REDIS)}:{self.redis_port}/0"

    def start_redis(self) -> None:
        """Start an empty Redis on the cluster's port."""
        self.redis = RedisServer(port=self.redis_port).start()

    def stop_redis(self) -> None:
        """Kill Redis; its data is gone (no persistence)."""
        assert self.redis is not None
        self.redis.stop()
        self.redis = None

    def start_worker(self, ports: WorkerPorts, *extra: str) -> None:
        argv = python_m(
            "worker", "--id", ports.worker_id, "--host", ports.host, "--port", str(ports.http),
            "--events", ports.events_endpoint, "--replay", ports.replay_endpoint,
            "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
            *WORKER_ARGS, *extra,
        )  # fmt: skip
        self.group.start(ports.worker_id, self.place(ports.worker_id, argv))

    def start_workers(self) -> None:
        """Start every worker and wait until all answer ``/health``."""
        for w in self.workers:
            self.start_worker(w)
        self.wait_healthy([w.url for w in self.workers])

    def start_router(self, name: str, specs: Sequence[str], *extra: str) -> str:
        """Start a router replica; returns its URL."""
        port = free_port()
        flags = [a for spec in specs for a in ("--worker", spec)]
        argv = python_m(
            "router", "--redis", self.redis_url, "--namespace", self.namespace,
            "--host", self.address(name), "--port", str(port), *flags, *extra,
        )  # fmt: skip
        self.group.start(name, self.place(name, argv))
        self.routers[name] = port
        return self.router_url(name)

    def router_url(self, name: str) -> str:
        return f"http://{self.address(name)}:{self.routers[name]}"

    def kill(self, name: str) -> None:
        """SIGKILL a process and forget it (it can be started again under its name)."""
        proc = self.group._procs[name]  # ProcessGroup has no kill(): reach its Popen
        proc.kill()
        proc.wait()
        self.group.stop([name])

    def freeze(self, name: str) -> None:
        """SIGSTOP a process: it keeps its sockets (connections are accepted) but answers
        nothing, like a hung host or a partitioned link."""
        self.group._procs[name].send_signal(signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        """SIGCONT a frozen process."""
        self.group._procs[name].send_signal(signal.SIGCONT)

    def wait_healthy(self, urls: Sequence[str]) -> None:
        async def run() -> None:
            deadline = time.monotonic() + START_TIMEOUT_S
            async with aiohttp.ClientSession() as session:
                for url in urls:
                    await wait_healthy(session, url, self.group, deadline)

        self.call(asyncio.run, run())

    def __enter__(self) -> Cluster:
        self.workers = [
            WorkerPorts(f"w{i}", host=self.address(f"w{i}")) for i in range(self.num_workers)
        ]
        self.start_redis()
        return self

    def __exit__(self, *exc: object) -> None:
        self.group.stop()
        if self.redis is not None:
            self.redis.stop()


# -- checks --------------------------------------------------------------------------------


def index_report(cluster: Cluster, workers: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """``kvroute index check --json`` for ``(worker_id, http_url)`` pairs: one row per
    worker (expected, indexed, missing, extra, tier mismatches, divergent)."""
    argv = python_m(
        "index", "check", "--redis", cluster.redis_url, "--namespace", cluster.namespace,
        "--json", *[a for wid, url in workers for a in ("--worker", f"{wid}={url}")],
        *cluster.check_args,
    )  # fmt: skip
    argv = cluster.place(CLIENT, argv)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    rows: list[dict[str, Any]] = json.loads(proc.stdout)
    return rows


def index_check(cluster: Cluster, workers: Sequence[tuple[str, str]]) -> dict[str, int]:
    """Divergent entries per worker, from :func:`index_report`."""
    return {c["worker_id"]: int(c["num_divergent"]) for c in index_report(cluster, workers)}


def wait_converged(
    cluster: Cluster,
    workers: Sequence[tuple[str, str]],
    bound_s: float,
    poke: Callable[[], object] = lambda: None,
) -> float:
    """Poll ``kvroute index check`` until every worker has 0 divergent entries, calling
    ``poke`` after each check that finds some.

    Returns:
        Seconds it took. Fails when ``bound_s`` passes first.
    """
    last: list[dict[str, Any]] = []

    def converged() -> bool:
        last[:] = index_report(cluster, workers)
        return not any(row["num_divergent"] for row in last)

    return wait_until(
        converged,
        lambda: f"the index to converge (last check: {last})",
        timeout_s=bound_s,
        poke=poke,
    )


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of ``GET url/metrics``."""

    async def get() -> str:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
            assert resp.status == 200
            return await resp.text()

    out = {}
    for family in text_string_to_metric_families(asyncio.run(get())):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float:  # fmt: skip
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def get_json(url: str) -> Any:
    async def get() -> Any:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            return resp.status, await resp.json()

    return asyncio.run(get())


def complete(url: str, prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
    """One completion; asserts 200."""

    async def post() -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            body = {"prompt": prompt, "max_tokens": max_tokens}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                result: dict[str, Any] = await resp.json()
                return result

    return asyncio.run(post())


def post_json(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any, float]:
    """POST ``body`` (with ``headers``): the status, the headers, the JSON answer and the
    seconds it took."""

    async def post() -> tuple[int, dict[str, str], Any, float]:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        start = time.monotonic()
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(url, json=body, headers=headers) as resp,
        ):
            answer = await resp.json(content_type=None)
            return resp.status, dict(resp.headers), answer, time.monotonic() - start

    return asyncio.run(post())


def family_prompts(seed: int, count: int, length: int = 6 * BLOCK_SIZE) -> list[list[int]]:
    """Prompts in 4 families sharing their first half (so prefixes are cached and routed)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(256) for _ in range(length // 2)] for _ in range(4)]
    return [heads[i % 4] + [rng.randrange(256) for _ in range(length // 2)] for i in range(count)]


# -- load ----------------------------------------------------------------------------------


@dataclass
class Load:
    """Closed-loop clients in a background thread, recording every request's outcome.

    Each request's time from sending to its outcome is kept in ``durations_s``, in order.
    Outcomes: ``"200"``, ``"<status> <error type>"`` for a JSON error body, ``"connection"``
    for a refused or dropped connection (the router process died), ``"bad <status>"`` for
    an error without a JSON message and ``"hang"`` for no answer in time.

    Args:
        urls: Each client picks the first URL that accepts its connection, in order.
        clients: Concurrent clients.
        seed: Prompt seed.
        runner: Runs the clients' thread body (e.g. inside a host's namespace); as is by
            default.
    """

    urls: Sequence[str]
    clients: int = 4
    seed: int = 0
    runner: Callable[[Callable[[], None]], None] = field(default=lambda body: body())
    outcomes: Counter[str] = field(default_factory=Counter)
    durations_s: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Load:
        self._thread = threading.Thread(
            target=self.runner, args=(lambda: asyncio.run(self._run()),), daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> Counter[str]:
        """Stop the clients (each finishes its request in flight); returns the outcomes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(REQUEST_TIMEOUT_S * 2)
            assert not self._thread.is_alive(), "load clients did not stop"
        return self.outcomes

    def wait_for(self, num_ok: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until ``num_ok`` more requests than now have succeeded."""
        target = self.outcomes["200"] + num_ok
        wait_until(
            lambda: self.outcomes["200"] >= target,
            lambda: f"{num_ok} more answered requests; load stalled: {dict(self.outcomes)}",
            timeout_s=timeout_s,
        )

    async def _run(self) -> None:
        prompts = family_prompts(self.seed, 32)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, k, prompts) for k in range(self.clients)))

    async def _client(
        self, session: aiohttp.ClientSession, k: int, prompts: list[list[int]]
    ) -> None:
        rng = random.Random(k)
        for n in itertools.count():
            if self._stop.is_set():
                return
            url = self.urls[(k + n) % len(self.urls)] if len(self.urls) > 1 else self.urls[0]
            body = {"prompt": rng.choice(prompts), "max_tokens": 2}
            start = time.monotonic()
            outcome = await self._one(session, url, body)
            self.durations_s.append(time.monotonic() - start)
            self.outcomes[outcome] += 1

    async def _one(self, session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
        try:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                raw = await resp.read()
                if resp.status == 200:
                    return "200"
                try:
                    error = json.loads(raw)["error"]
                    assert error["message"]
                    return f"{resp.status} {error['type']}"
                except (ValueError, KeyError, TypeError, AssertionError):
                    return f"bad {resp.status}"
        except asyncio.TimeoutError:
            return "hang"
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)  # a dead router: do not spin on refused connections
            return "connection"


# -- a worker without a model ------------------------------------------------------------


class SyntheticWorker:
    """A real pool and publisher with the worker's ``/health`` and ``/v1/snapshot``.

    Each :meth:`step` runs one request through the ``KVCacheManager`` (hit, allocate,
    cache, free) and publishes its events as one batch, like one engine step. Each
    instance is one publisher lifetime: both endpoints report its ``lifetime_id``.

    Args:
        worker_id: Its id.
        hwm: PUB send high-water mark (small: drops sooner).
        buffer_steps: Batches kept for replay.
        skip_live_seqs: Seqs kept for replay but never sent live (loss injection; an
            object that contains every seq makes the test send the live stream itself).
        ports: Reuse these ports (a worker restarted in place); fresh ones by default.
    """

    def __init__(
        self,
        worker_id: str,
        *,
        hwm: int = 100_000,
        buffer_steps: int = 10_000,
        skip_live_seqs: Collection[int] | None = None,
        ports: WorkerPorts | None = None,
    ) -> None:
        self.ports = ports if ports is not None else WorkerPorts(worker_id)
        self.kv = KVCacheManager(KVCacheConfig(NUM_BLOCKS, BLOCK_SIZE, enable_kv_cache_events=True))
        self.chains = CachedChains(BLOCK_SIZE)
        self.skip_live_seqs = skip_live_seqs if skip_live_seqs is not None else set()
        self.publisher = EventPublisher(
            PublisherConfig(
                endpoint=Endpoint.binding(f"tcp://{HOST}:{self.ports.events}"),
                replay_endpoint=Endpoint.binding(f"tcp://{HOST}:{self.ports.replay}"),
                hwm=hwm,
                buffer_steps=buffer_steps,
            ),
            skip_live_seqs=self.skip_live_seqs,
        )
        self.lifetime_id = new_lifetime_id()
        self.last_batch: KVEventBatch | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(30)

    @property
    def url(self) -> str:
        return self.ports.url

    def step(self, prompt: Sequence[int]) -> int:
        """One request through the pool; returns the seq its batch got (-1: no events)."""
        with self._lock:
            request = self.kv.make_request(f"r{next(self._ids)}", prompt)
            hits, num_hit = self.kv.get_computed_blocks(request)
            allocated = self.kv.allocate_slots(request, len(prompt) - num_hit, num_hit, hits)
            assert allocated is not None, "prompt too long for the synthetic pool"
            self.kv.free(request)
            events = self.kv.take_events()
            if not events:
                return -1
            self.chains.apply(events)
            seq = self.publisher.next_seq
            self.last_batch = KVEventBatch(ts=time.time(), events=events)
            assert self.publisher.publish(self.last_batch)
            return seq

    def steps(self, prompts: Iterator[list[int]] | Sequence[list[int]]) -> None:
        for prompt in prompts:
            self.step(prompt)

    async def _serve(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/health", self._health), web.get("/v1/snapshot", self._snapshot)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, self.ports.http).start()

    async def _health(self, request: web.Request) -> web.Response:
        with self._lock:
            free = self.kv.block_pool.get_num_free_blocks()
        return web.json_response(
            {"status": "ok", "worker_id": self.ports.worker_id,
             "lifetime_id": self.lifetime_id, "running": 0, "waiting": 0,
             "free_blocks": free, "total_blocks": NUM_BLOCKS - 1,
             "usage": 1 - free / (NUM_BLOCKS - 1)}
        )  # fmt: skip

    async def _snapshot(self, request: web.Request) -> web.Response:
        with self._lock:
            body = {"worker_id": self.ports.worker_id, "lifetime_id": self.lifetime_id,
                    "block_size": BLOCK_SIZE,
                    "hash_algo": "sha256_cbor", "medium": "GPU",
                    "next_seq": self.publisher.next_seq, "runs": self.chains.runs()}  # fmt: skip
        return web.json_response(body)

    def close(self) -> None:
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self.publisher.close()

    def __enter__(self) -> SyntheticWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- streams ------------------------------------------------------------------------------


def unique_prompts(seed: int, num_blocks: int = 16) -> Iterator[list[int]]:
    """Random prompts of ``num_blocks`` full blocks, reproducible from ``seed``."""
    rng = random.Random(seed)
    while True:
        yield [rng.randrange(256) for _ in range(num_blocks * BLOCK_SIZE)]


def handshake(
    cluster: Cluster, router: str, worker: SyntheticWorker, prompts: Iterator[list[int]]
) -> None:
    """Wait until the router owns the worker and receives its live batches (slow joiner)."""
    wid = worker.ports.worker_id

    def receiving() -> bool:
        samples = scrape(router)
        if metric(samples, "kvroute_stream_batches_total", worker=wid) >= 1:
            return True
        cluster.group.check_alive()
        if metric(samples, "kvroute_ingest_snapshots_total", worker=wid, outcome="ok") >= 1:
            worker.step(next(prompts))  # a probe, once the router has loaded the snapshot
        return False

    wait_until(receiving, "the router to receive the worker's events", timeout_s=60)
