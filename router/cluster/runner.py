"""Run a whole local kvroute cluster and measure one workload through it, once per policy.

:func:`run_cluster` uses the Redis it is given or starts one, then, for each policy:
starts N ``kvroute worker`` subprocesses and a ``kvroute router`` subprocess in front of
them, waits for their health checks, sends the workload through the router's
``/v1/completions`` with a fixed number of requests in flight, and stops every process
again, so each policy starts from cold caches and an empty index (its own namespace).
Workers are subprocesses started with ``python -m router worker``: this module imports
nothing from ``pool``.

NOTE: every process this module starts is registered in a
:class:`router.cluster.processes.ProcessGroup` before anything else can fail, and the group stops
them all on exit, error or Ctrl-C (or SIGKILL of this process, on Linux).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisError

from events.identity import WorkerId
from events.recorder import last_batch_seqs
from router.cluster.processes import (
    ProcessError,
    ProcessGroup,
    terminate_as_interrupt,
    wait_healthy,
)
from router.cluster.report import ClusterReport, PolicyRun, RequestResult, WorkerStats
from router.cluster.workload import (
    Workload,
    WorkloadRequest,
    ideal_hit_tokens,
    pooled_lru_hit_tokens,
)
from router.errors import RouterError
from router.store.connection import connect
from router.store.server import RedisServer, free_port

__all__ = [
    "ClusterConfig",
    "ClusterError",
    "ProcessError",
    "ProcessGroup",
    "run_cluster",
    "wait_healthy",
]

_LOG: Final = logging.getLogger(__name__)
_HOST: Final = "127.0.0.1"


class ClusterError(RouterError, RuntimeError):
    """The cluster's settings are invalid, or a worker's metrics or events could not be read."""


@dataclass(frozen=True)
class ClusterConfig:
    """How to build the local cluster and drive it.

    Attributes:
        num_workers: Worker processes.
        policies: Routing policies to run the workload under, in order.
        redis_url: An existing Redis to use; ``None`` starts a private one.
        num_blocks: KV cache blocks per worker.
        block_size: Tokens per block.
        concurrency: Requests in flight at once (a closed loop).
        worker_args: Extra ``kvroute worker`` flags (e.g. model size).
        router_args: Extra ``kvroute router`` flags (e.g. cost weights).
        startup_timeout_s: How long a process may take to answer its health check.
        request_timeout_s: How long one request may take.
        log_dir: Where each process's stdout/stderr goes (``NAME.log``).
        record_dir: When set, each policy's run also records every worker's KV events
            (``POLICY.kvlog``, by ``kvroute record``) and the router's decisions
            (``POLICY.decisions.jsonl``) there, for ``kvroute replay`` and ``explain``.
    """

    num_workers: int = 4
    policies: tuple[str, ...] = ("cache_aware", "round_robin")
    redis_url: str | None = None
    num_blocks: int = 512
    block_size: int = 16
    concurrency: int = 4
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    startup_timeout_s: float = 120.0
    request_timeout_s: float = 120.0
    log_dir: Path = field(default_factory=lambda: Path("kvroute-cluster-logs"))
    record_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.concurrency < 1 or not self.policies:
            raise ClusterError(
                "need at least one worker, one request in flight and one policy, got "
                f"{self.num_workers}, {self.concurrency}, {self.policies}"
            )


def _python_m(*args: str) -> list[str]:
    return [sys.executable, "-m", "router", *args]


@dataclass(frozen=True, slots=True)
class _WorkerPorts:
    worker_id: str
    http: int
    events: int
    replay: int

    @property
    def url(self) -> str:
        return f"http://{_HOST}:{self.http}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{_HOST}:{self.events}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{_HOST}:{self.replay}"


def _torch_threads(num_workers: int) -> int:
    """Torch CPU threads per worker: the cores split between the workers.

    N workers each running one thread per core oversubscribe the CPU: on 2 cores, 4
    workers took 22 s instead of 8 s for the same 200 requests (measured while sizing
    ``kvroute cluster``). ``--worker-arg=--torch-threads=K`` overrides it.
    """
    return max(1, (os.cpu_count() or 1) // num_workers)


def _worker_argv(ports: _WorkerPorts, config: ClusterConfig) -> list[str]:
    return _python_m(
        "worker",
        "--id", ports.worker_id,
        "--host", _HOST,
        "--port", str(ports.http),
        "--events", ports.events_endpoint,
        "--replay", ports.replay_endpoint,
        "--num-blocks", str(config.num_blocks),
        "--block-size", str(config.block_size),
        "--torch-threads", str(_torch_threads(config.num_workers)),
        *config.worker_args,
    )  # fmt: skip


def _router_argv(
    workers: Sequence[_WorkerPorts],
    *,
    policy: str,
    redis_url: str,
    namespace: str,
    port: int,
    config: ClusterConfig,
    decision_log: Path | None,
) -> list[str]:
    argv = _python_m(
        "router",
        "--redis", redis_url,
        "--namespace", namespace,
        "--host", _HOST,
        "--port", str(port),
        "--policy", policy,
    )  # fmt: skip
    for w in workers:
        argv += [
            "--worker",
            f"{w.worker_id}={w.url},events={w.events_endpoint},replay={w.replay_endpoint},"
            f"block-size={config.block_size}",
        ]
    if decision_log is not None:
        argv += ["--decision-log", str(decision_log)]
    return [*argv, *config.router_args]


def _record_argv(workers: Sequence[_WorkerPorts], log: Path) -> list[str]:
    argv = _python_m("record", "--out", str(log), "--flush-interval-s", "0.1")
    for w in workers:
        argv += ["--worker", f"{w.worker_id}={w.events_endpoint},replay={w.replay_endpoint}"]
    return argv


async def _recorder_joined(
    session: aiohttp.ClientSession, workers: Sequence[_WorkerPorts], log: Path, deadline: float
) -> None:
    """Handshake: reset each (still empty) cache until the recorder has logged its event.

    A subscriber that connects late misses what was published before; probes are sent
    until one is seen rather than hoping a sleep was long enough.
    """
    for w in workers:
        while w.worker_id not in last_batch_seqs(log):
            if time.monotonic() > deadline:
                raise ClusterError(f"the event recorder never received {w.worker_id}'s events")
            async with session.post(f"{w.url}/v1/reset_prefix_cache") as resp:
                resp.raise_for_status()
            await asyncio.sleep(0.2)  # let the probe land before sending another


async def _recorder_caught_up(
    session: aiohttp.ClientSession, workers: Sequence[_WorkerPorts], log: Path, timeout_s: float
) -> None:
    """Wait until the log holds the last batch every worker published."""
    deadline = time.monotonic() + timeout_s
    while True:
        published = [await _scrape(session, w.url) for w in workers]
        wanted = {
            w.worker_id: int(m.get(("kvroute_worker_event_batches_published_total", ""), 0)) - 1
            for w, m in zip(workers, published, strict=True)
        }
        have = last_batch_seqs(log)
        if all(have.get(WorkerId(w), -1) >= seq for w, seq in wanted.items()):
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"the event log has seqs {have}, the workers published {wanted}")
        await asyncio.sleep(0.1)  # the recorder flushes every 0.1 s; poll its file


async def _send(
    session: aiohttp.ClientSession, router_url: str, request: WorkloadRequest
) -> RequestResult:
    """Send one streaming completion through the router and time it."""
    body = {
        "prompt": list(request.token_ids),
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    num_prompt = len(request.token_ids)
    start = time.perf_counter()
    ttft_s: float | None = None
    usage: dict[str, Any] = {}
    try:
        async with session.post(f"{router_url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                return RequestResult(num_prompt, error=f"HTTP {resp.status}: {text}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if ttft_s is None and chunk.get("choices"):
                    ttft_s = time.perf_counter() - start
                usage = chunk.get("usage") or usage
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return RequestResult(num_prompt, error=f"{type(exc).__name__}: {exc}")
    latency_s = time.perf_counter() - start
    return RequestResult(
        prompt_tokens=num_prompt,
        cached_tokens=_cached_tokens(usage),
        output_tokens=int(usage.get("completion_tokens", 0)),
        ttft_s=latency_s if ttft_s is None else ttft_s,
        latency_s=latency_s,
    )


def _cached_tokens(usage: dict[str, Any]) -> int:
    """``usage.cached_tokens`` (kvroute) or ``usage.prompt_tokens_details.cached_tokens``."""
    if "cached_tokens" in usage:
        return int(usage["cached_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens", 0))


async def _scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """A worker's Prometheus samples: (name, ``kind`` label) -> value summed over labels."""
    async with session.get(f"{url}/metrics") as resp:
        if resp.status != 200:
            raise ClusterError(f"{url}/metrics answered HTTP {resp.status}")
        text = await resp.text()
    totals: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("kind", ""))
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


async def _worker_stats(session: aiohttp.ClientSession, worker: _WorkerPorts) -> WorkerStats:
    """Read what a worker served from its Prometheus ``/metrics``."""
    totals = await _scrape(session, worker.url)
    return WorkerStats(
        worker_id=worker.worker_id,
        num_requests=int(totals.get(("kvroute_worker_requests_total", ""), 0)),
        prompt_tokens=int(totals.get(("kvroute_worker_tokens_total", "prompt"), 0)),
        cached_tokens=int(totals.get(("kvroute_worker_prefix_hit_tokens_total", ""), 0)),
    )


ProgressFn = Callable[[str, RequestResult], None]
"""Called with the policy name after each request finishes."""


async def _drive(
    session: aiohttp.ClientSession,
    router_url: str,
    policy: str,
    workload: Workload,
    concurrency: int,
    progress: ProgressFn | None,
) -> tuple[list[RequestResult], float]:
    """Send every request, ``concurrency`` at a time, in workload order."""
    results: list[RequestResult | None] = [None] * len(workload.requests)
    pending = iter(enumerate(workload.requests))

    async def client() -> None:
        for i, request in pending:
            results[i] = result = await _send(session, router_url, request)
            if progress is not None:
                progress(policy, result)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall_s = time.perf_counter() - start
    return [r for r in results if r is not None], wall_s


def _unique_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return list(ports)


async def _run_policy(
    policy: str,
    workload: Workload,
    config: ClusterConfig,
    redis_url: str,
    group: ProcessGroup,
    progress: ProgressFn | None,
) -> PolicyRun:
    """Start cold workers and a router with ``policy``, drive the workload, stop them."""
    ports = _unique_ports(3 * config.num_workers + 1)
    workers = [
        _WorkerPorts(f"worker-{i}", *ports[3 * i : 3 * i + 3]) for i in range(config.num_workers)
    ]
    record = config.record_dir
    namespace = f"cluster-{uuid.uuid4().hex[:8]}-{policy}"
    names = [w.worker_id for w in workers] + ["router", "record"]
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    try:
        for w in workers:
            group.start(w.worker_id, _worker_argv(w, config))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            deadline = time.monotonic() + config.startup_timeout_s
            await asyncio.gather(*(wait_healthy(session, w.url, group, deadline) for w in workers))
            if record is not None:
                record.mkdir(parents=True, exist_ok=True)
                for stale in (f"{policy}.kvlog", f"{policy}.decisions.jsonl"):
                    (record / stale).unlink(missing_ok=True)  # both files are appended to
                group.start("record", _record_argv(workers, record / f"{policy}.kvlog"))
                await _recorder_joined(session, workers, record / f"{policy}.kvlog", deadline)
            router_argv = _router_argv(
                workers,
                policy=policy,
                redis_url=redis_url,
                namespace=namespace,
                port=ports[-1],
                config=config,
                decision_log=None if record is None else record / f"{policy}.decisions.jsonl",
            )
            group.start("router", router_argv)
            router_url = f"http://{_HOST}:{ports[-1]}"
            await wait_healthy(session, router_url, group, deadline)
            _LOG.info("%s: %d workers and the router are up", policy, len(workers))
            results, wall_s = await _drive(
                session, router_url, policy, workload, config.concurrency, progress
            )
            group.check_alive()
            stats = await asyncio.gather(*(_worker_stats(session, w) for w in workers))
            if record is not None:
                log = record / f"{policy}.kvlog"
                await _recorder_caught_up(session, workers, log, config.startup_timeout_s)
    finally:
        group.stop(names)
        if config.redis_url is not None:
            await _drop_namespace(redis_url, namespace)
    return PolicyRun(policy, tuple(stats), tuple(results), wall_s)


async def _check_redis(redis_url: str) -> None:
    """Fail before any process starts when the given Redis does not answer.

    Raises:
        ClusterError: Says which URL and why, and how to do without it.
    """
    try:
        client = await connect(redis_url)
    except RouterError as exc:
        raise ClusterError(f"{exc}; or leave out --redis to start a private one") from exc
    await client.aclose()


async def _drop_namespace(redis_url: str, namespace: str) -> None:
    """Delete a finished run's keys from a Redis the user gave (ours is simply killed).

    NOTE: a SCAN is fine here: once per run, over one namespace nobody else uses.
    """
    try:
        client = await connect(redis_url)
    except RouterError as exc:
        _LOG.warning("could not remove namespace %r from Redis: %s", namespace, exc)
        return
    try:
        keys = [key async for key in client.scan_iter(match=f"kvroute:{namespace}:*")]
        for start in range(0, len(keys), 1000):
            await client.delete(*keys[start : start + 1000])
    except RedisError as exc:
        _LOG.warning("could not remove namespace %r from Redis: %s", namespace, exc)
    finally:
        await client.aclose()


def run_cluster(
    workload: Workload,
    config: ClusterConfig | None = None,
    progress: ProgressFn | None = None,
) -> ClusterReport:
    """Run ``workload`` through a fresh local cluster once per policy.

    Args:
        workload: The requests to send.
        config: The cluster; ``None`` means the defaults.
        progress: Called after every request (e.g. to advance a progress bar).

    Returns:
        The report of every policy's run.

    Raises:
        ProcessError: A process failed to start, never became healthy, or died.
        ClusterError: The given Redis does not answer (checked before anything starts),
            or a worker's metrics or events could not be read.
        RedisServerError: No Redis was given and none could be started.
    """
    config = config or ClusterConfig()
    if config.redis_url is not None:
        asyncio.run(_check_redis(config.redis_url))
    runs: list[PolicyRun] = []
    with terminate_as_interrupt(), contextlib.ExitStack() as stack:
        redis_url = config.redis_url or stack.enter_context(RedisServer()).url
        group = stack.enter_context(ProcessGroup(config.log_dir))
        for policy in config.policies:
            runs.append(
                asyncio.run(_run_policy(policy, workload, config, redis_url, group, progress))
            )
    prompts = [r.token_ids for r in workload.requests]
    total = workload.num_prompt_tokens
    ideal = ideal_hit_tokens(prompts, config.block_size) / total if total else 0.0
    capacity = config.num_workers * (config.num_blocks - 1)  # each worker's null block aside
    lru = 0.0
    if total and capacity > 0:
        lru = pooled_lru_hit_tokens(prompts, config.block_size, capacity) / total
    return ClusterReport(workload.description, len(workload.requests), ideal, tuple(runs), lru)
