"""Router throughput under concurrent clients: requests/s and p50/p99, beside a bare proxy.

One run starts an embedded Redis, ``--workers`` real ``kvroute worker`` processes (tiny
model), one ``kvroute router`` and one bare HTTP proxy (this module with ``--bare-proxy``:
round-robin, no index, no decision, the same aiohttp stack), all as separate processes on
loopback. ``--clients`` concurrent closed-loop clients then send completions
(``max_tokens`` 1, prompts drawn from a fixed set sharing prefixes) for ``--duration-s`` per
row to: a worker directly (the floor), the bare proxy (the baseline), the router's
``/v1/completions`` and the router's ``/v1/route`` (the decision alone). The table gives
requests/s, p50 and p99 latency and each row's ratio to the bare proxy.

:class:`LocalStack` (Redis + workers + router as processes) is reused by ``bench_soak``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web

from benchmarks.environment import describe
from events.cli.flags import add_flag
from router.cluster.report import percentile
from router.cluster.runner import ProcessGroup, wait_healthy
from router.store.server import RedisServer, free_port

HOST = "127.0.0.1"
START_TIMEOUT_S = 180.0


@dataclass
class LocalStack:
    """Redis, kvroute workers and one kvroute router as local processes (a context manager).

    Args:
        log_dir: Where each process logs (``NAME.log``).
        num_workers: Workers to start.
        num_blocks: KV cache blocks per worker (their capacity).
        block_size: Tokens per block.
        router_args: Extra ``kvroute router`` flags.
        worker_args: Extra ``kvroute worker`` flags (default: the tiniest model).
    """

    log_dir: Path
    num_workers: int = 2
    num_blocks: int = 256
    block_size: int = 16
    router_args: Sequence[str] = ()
    worker_args: Sequence[str] = ("--num-layers", "1", "--hidden-size", "32", "--num-heads", "2")
    namespace: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:8]}")
    worker_urls: list[str] = field(default_factory=list)
    router_url: str = ""
    router_pid: int = 0
    redis: RedisServer | None = None
    group: ProcessGroup | None = None

    def __enter__(self) -> LocalStack:
        self.redis = RedisServer().start()
        self.group = ProcessGroup(self.log_dir)
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        assert self.group is not None and self.redis is not None
        specs = []
        for i in range(self.num_workers):
            http, events, replay = free_port(), free_port(), free_port()
            url = f"http://{HOST}:{http}"
            self.group.start(
                f"worker{i}",
                [sys.executable, "-m", "router", "worker", "--id", f"w{i}",
                 "--port", str(http),
                 "--events", f"tcp://{HOST}:{events}", "--replay", f"tcp://{HOST}:{replay}",
                 "--num-blocks", str(self.num_blocks), "--block-size", str(self.block_size),
                 *self.worker_args],
            )  # fmt: skip
            self.worker_urls.append(url)
            specs += ["--worker", f"w{i}={url},events=tcp://{HOST}:{events},"
                      f"replay=tcp://{HOST}:{replay},block-size={self.block_size}"]  # fmt: skip
        port = free_port()
        self.router_url = f"http://{HOST}:{port}"
        proc = self.group.start(
            "router",
            [sys.executable, "-m", "router", "router", "--redis", self.redis.url,
             "--namespace", self.namespace, "--port", str(port), "--log-level", "WARNING",
             *specs, *self.router_args],
        )  # fmt: skip
        self.router_pid = proc.pid
        asyncio.run(self.wait_healthy([*self.worker_urls, self.router_url]))

    async def wait_healthy(self, urls: list[str]) -> None:
        """Wait until every URL's ``/health`` answers 200 (fails if a process died)."""
        assert self.group is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        async with aiohttp.ClientSession() as session:
            for url in urls:
                await wait_healthy(session, url, self.group, deadline)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.group is not None:
            self.group.stop()
        if self.redis is not None:
            self.redis.stop()


# -- the bare proxy -----------------------------------------------------------------------


def run_bare_proxy(port: int, upstreams: list[str], event_loop: str = "asyncio") -> None:
    """Serve a round-robin reverse proxy of ``POST /v1/completions`` and ``GET /health``."""
    cycle = itertools.cycle(upstreams)

    async def forward(request: web.Request) -> web.Response:
        session: aiohttp.ClientSession = request.app[SESSION]
        body = await request.read()
        target = f"{next(cycle)}{request.path}"
        async with session.request(
            request.method, target, data=body, headers={"Content-Type": "application/json"}
        ) as upstream:
            payload = await upstream.read()
            return web.Response(
                body=payload, status=upstream.status, content_type=upstream.content_type
            )

    async def open_session(app: web.Application) -> Any:
        app[SESSION] = aiohttp.ClientSession()
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(open_session)
    app.add_routes([web.post("/v1/completions", forward), web.get("/health", forward)])
    loop = None
    if event_loop == "uvloop":  # the router's loop, for a like-for-like baseline
        import uvloop

        loop = uvloop.new_event_loop()
    web.run_app(app, host=HOST, port=port, print=None, access_log=None, loop=loop)


SESSION = web.AppKey("session", aiohttp.ClientSession)


# -- load ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One measured target."""

    name: str
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int


def make_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts in 8 families sharing their first half (cache reuse for a router)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(256) for _ in range(length // 2)] for _ in range(8)]
    return [
        heads[i % 8] + [rng.randrange(256) for _ in range(length - length // 2)]
        for i in range(count)
    ]


async def closed_loop(
    urls: list[str], prompts: list[list[int]], clients: int, seconds: float, warmup_s: float
) -> tuple[list[float], int]:
    """``clients`` tasks each POSTing one request after another (client k to
    ``urls[k % len(urls)]``); returns the latencies after warm-up and the errors."""
    latencies: list[float] = []
    errors = 0
    start = time.monotonic()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=60)

    async def client(k: int) -> None:
        nonlocal errors
        rng = random.Random(k)
        url = urls[k % len(urls)]
        while (now := time.monotonic()) < stop_at:
            body = {"prompt": rng.choice(prompts), "max_tokens": 1}
            async with session.post(url, json=body) as response:
                await response.read()
                ok = response.status == 200
            done = time.monotonic()
            if now >= measure_from:
                if ok:
                    latencies.append(done - now)
                else:
                    errors += 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(k) for k in range(clients)))
    return latencies, errors


def measure(
    name: str, urls: list[str], prompts: list[list[int]], clients: int, seconds: float
) -> Row:
    """Run the closed loop against ``urls`` and summarise it."""
    latencies, errors = asyncio.run(closed_loop(urls, prompts, clients, seconds, seconds / 4))
    assert latencies, f"{name}: no request succeeded ({errors} errors)"
    return Row(
        name,
        len(latencies) / seconds,
        statistics.median(latencies) * 1000,
        percentile(latencies, 99) * 1000,
        errors,
    )


def print_table(rows: list[Row], baseline: Row) -> None:
    print(f"{'target':<38} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} "
          f"{'rps ratio':>9} {'p99 ratio':>9}")  # fmt: skip
    for row in rows:
        print(
            f"{row.name:<38} {row.requests_per_s:>8.1f} {row.p50_ms:>8.2f} {row.p99_ms:>8.2f} "
            f"{row.errors:>6} {row.requests_per_s / baseline.requests_per_s:>9.2f} "
            f"{row.p99_ms / baseline.p99_ms:>9.2f}"
        )
    print("ratios are to the bare proxy row, measured in the same run")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--bare-proxy``, be its proxy process)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_throughput",
        description="Router requests/s and p50/p99 latency under concurrent clients, beside "
        "a bare round-robin proxy and a direct worker, all measured in the same run.",
    )
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--workers", type=int, default=2, help="kvroute workers (default: 2)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default: 16)")
    add_flag(
        parser, "--duration-s", aliases=("--seconds",), type=float, default_text="20; --quick: 2",
        meaning="measured seconds per row",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-tokens", type=int, default=128, help="tokens per prompt (default: 128)"
    )
    parser.add_argument("--log-dir", default=None, help="process logs (default: a temp dir)")
    parser.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="event loop of the router and of the bare proxy (default: asyncio)",
    )
    parser.add_argument("--bare-proxy", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.bare_proxy:
        run_bare_proxy(args.bare_proxy, args.upstream, args.event_loop)
        return 0
    seconds = args.duration_s or (2.0 if args.quick else 20.0)
    clients = min(args.clients, 8) if args.quick else args.clients
    prompts = make_prompts(64, args.prompt_tokens)
    log_dir = Path(args.log_dir or f"/tmp/kvroute-bench-throughput-{uuid.uuid4().hex[:8]}")
    print("bench_throughput:", describe(("aiohttp", "redis", "msgspec")))
    print(f"{args.workers} workers, {clients} closed-loop clients, {seconds:.0f} s per row, "
          f"{args.prompt_tokens}-token prompts, max_tokens 1; logs in {log_dir}")  # fmt: skip
    loop_args = ("--event-loop", args.event_loop)
    print(f"event loop of the router and the bare proxy: {args.event_loop}")
    with LocalStack(log_dir, num_workers=args.workers, router_args=loop_args) as stack:
        assert stack.group is not None
        proxy_port = free_port()
        upstreams = [a for url in stack.worker_urls for a in ("--upstream", url)]
        stack.group.start(
            "bare_proxy",
            [sys.executable, "-m", "benchmarks.bench_throughput",
             "--bare-proxy", str(proxy_port), *upstreams, *loop_args],
        )  # fmt: skip
        proxy_url = f"http://{HOST}:{proxy_port}"
        asyncio.run(stack.wait_healthy([proxy_url]))
        targets = [
            ("workers directly (floor)", [f"{u}/v1/completions" for u in stack.worker_urls]),
            ("bare proxy, round robin (baseline)", [f"{proxy_url}/v1/completions"]),
            ("kvroute router /v1/completions", [f"{stack.router_url}/v1/completions"]),
            ("kvroute router /v1/route (decision)", [f"{stack.router_url}/v1/route"]),
        ]
        rows = [measure(name, url, prompts, clients, seconds) for name, url in targets]
        stack.group.check_alive()
    print_table(rows, rows[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
