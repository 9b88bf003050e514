"""``kvroute index``: check the Redis prefix index against kvroute workers, stats, registry.

``kvroute index check`` folds each worker's ``GET /v1/snapshot`` into a fresh engine-hash
bridge (exactly what ingest would write) and compares the result with the worker's
entries in Redis: missing entries, extra entries and tier mismatches, per worker; and
flags a worker whose events (as the router reading them recorded, or its snapshot) carry
another block size than its registration; exit code 1 if any. With ``--router URL`` it
also reports each worker's routing accuracy as that router measures it (the cached tokens
it expected against those the worker reported, :mod:`router.front.accuracy`), vLLM
engines included, and exits 1 when one is below ``--accuracy-warn-below-ratio``.
``kvroute index stats``
prints entries, keys, workers and memory.
``kvroute index register`` / ``unregister`` / ``workers`` manage the persistent worker
registrations that every router replica ingests (from ``--worker`` specs or a JSON file).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import aiohttp
import msgspec

from events.auth import WORKER_ADMIN_KEY, AuthKeyError, add_key_arguments, load_sent_key
from events.cli.flags import add_flag
from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from router.errors import RouterError
from router.front.accuracy import AccuracyConfig, ReportedAccuracy, parse_router_accuracy
from router.index.base import IndexStats, PrefixIndex
from router.index.changes import Changes
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridge import WorkerBridge
from router.store.connection import RedisClient, RedisOptions, connect, redact_url, reply_bytes
from router.store.layout import NAMESPACE_MARKERS, KeyLayout, namespace_of
from router.workers.leases import owner_of
from router.workers.registration import RegistrationConflict
from router.workers.registry import WorkerRegistry, load_records, parse_worker_spec
from router.workers.snapshot import fetch_snapshot, snapshot_events

__all__ = ["WorkerCheck", "check_workers", "expected_entries", "main"]

log = logging.getLogger("kvroute.index")


@dataclass(frozen=True, slots=True)
class WorkerCheck:
    """How one worker's entries in the index compare with its snapshot.

    Attributes:
        worker_id: The worker.
        num_expected: Entries its snapshot implies (router keys).
        num_indexed: Entries the index holds for it.
        num_missing: Expected but not indexed (claims too little: safe, lost hits).
        num_extra: Indexed but not expected (claims too much: misroutes).
        num_tier_mismatch: In both, on different tiers.
        registered_block_size: The block size it is registered with (``None``: not
            registered).
        events_block_size: The block size its events or snapshot carry when that is not
            the registered one (``None``: they agree); its ``BlockStored`` events are
            dropped by the ingest until it is registered right.
    """

    worker_id: str
    num_expected: int
    num_indexed: int
    num_missing: int
    num_extra: int
    num_tier_mismatch: int
    registered_block_size: int | None = None
    events_block_size: int | None = None

    @property
    def num_divergent(self) -> int:
        """Entries that differ in any way."""
        return self.num_missing + self.num_extra + self.num_tier_mismatch

    @property
    def block_size_mismatch(self) -> bool:
        """Whether its events disagree with its registration's block size."""
        return self.events_block_size is not None


async def expected_entries(
    keyer: RouterKeyer, session: aiohttp.ClientSession, http_url: str
) -> tuple[dict[BlockKey, int], int]:
    """Router key -> tier mask that a worker's current snapshot implies, and the
    snapshot's block size."""
    snapshot = await fetch_snapshot(session, http_url)
    # Tolerant, like a snapshot load: runs under an evicted ancestor are unreachable.
    bridge = WorkerBridge(keyer, tolerate_orphans=True)
    for event in snapshot_events(snapshot):
        bridge.store(event, Changes())
    return {key: mask for key, (_, mask) in bridge.entries().items()}, snapshot.block_size


async def check_workers(
    index: PrefixIndex,
    keyer: RouterKeyer,
    session: aiohttp.ClientSession,
    targets: Sequence[tuple[WorkerId, str]],
    registry: WorkerRegistry | None = None,
) -> list[WorkerCheck]:
    """Compare each ``(worker id, http url)`` worker's snapshot with its index entries
    (and, given the ``registry``, its block size with its registration's); ``keyer`` is
    the router key function the index was written with."""
    registered: dict[WorkerId, int] = {}
    flagged: dict[WorkerId, int] = {}
    if registry is not None:
        registered = {r.worker_id: r.block_size for r in await registry.records()}
        flagged = await registry.events_block_sizes([w for w, _ in targets])
    out: list[WorkerCheck] = []
    for worker_id, http_url in targets:
        expected, snapshot_block_size = await expected_entries(keyer, session, http_url)
        indexed = await index.worker_entries(WorkerId(worker_id))
        both = expected.keys() & indexed.keys()
        block_size = registered.get(worker_id)
        seen = flagged.get(worker_id)
        if seen is None and block_size is not None and snapshot_block_size != block_size:
            seen = snapshot_block_size
        out.append(
            WorkerCheck(
                worker_id=worker_id,
                num_expected=len(expected),
                num_indexed=len(indexed),
                num_missing=len(expected.keys() - indexed.keys()),
                num_extra=len(indexed.keys() - expected.keys()),
                num_tier_mismatch=sum(1 for k in both if expected[k] != indexed[k]),
                registered_block_size=block_size,
                events_block_size=seen,
            )
        )
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute index",
        description="Inspect the global prefix index in Redis.",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis",
        default="redis://127.0.0.1:6379/0",
        help="Redis URL: redis://[:PASSWORD@]HOST:PORT/DB, rediss://... for TLS; a Redis "
        "Cluster node is detected (default: %(default)s)",
    )
    common.add_argument(
        "--namespace",
        help="key namespace kvroute:NS:... (default: 'default'; `stats` without it lists "
        "every namespace it finds)",
    )
    common.add_argument("--tls-ca", help="CA file that signed the server's TLS certificate")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    check = sub.add_parser(
        "check",
        parents=[common],
        help="compare the index with workers' /v1/snapshot (exit 1 on divergence)",
        description="Compare the index with each kvroute worker's GET /v1/snapshot and "
        "print missing, extra and tier-mismatched entries per worker, and flag a worker "
        "whose events carry another block size than its registration; exit code 1 if any.",
    )
    check.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ID=HTTP_URL",
        help="a kvroute worker to check (repeatable); default: every registered worker "
        "of kind kvroute with an HTTP URL",
    )
    check.add_argument(
        "--seed", type=int, default=0, help="router key seed the cluster uses (default: 0)"
    )
    add_key_arguments(check, WORKER_ADMIN_KEY)
    add_flag(
        check,
        "--router",
        metavar="URL",
        meaning="also report each worker's routing accuracy from this router's /metrics: the "
        "cached tokens it expected against those the worker reported (every worker it "
        "served, vLLM engines included); with it, no kvroute worker to compare is needed",
    )
    add_flag(
        check,
        "--accuracy-warn-below-ratio",
        type=float,
        default=AccuracyConfig().warn_below_ratio,
        meaning="with --router: a worker whose accuracy is below this fails the check (the "
        "router's own default)",
    )
    sub.add_parser(
        "stats",
        parents=[common],
        help="print entries, keys, workers and Redis memory (per namespace)",
        description="Print the index's entries, distinct keys, workers and Redis memory; "
        "without --namespace, one line per namespace found on the server (it scans the "
        "keyspace once for the namespaces' marker keys).",
    )
    register = sub.add_parser(
        "register",
        parents=[common],
        help="register workers for every router replica to ingest (persisted in Redis)",
        description="Add worker registrations in Redis; running routers pick them up at "
        "their next maintenance pass. Each is validated first (nothing is saved if one is "
        "invalid); a worker id already registered with other settings is refused unless "
        "--replace is given.",
    )
    register.add_argument(
        "--replace",
        action="store_true",
        help="replace a worker's registration that differs (default: refuse it)",
    )
    register.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="SPEC",
        help="ID=EVENTS_ENDPOINT[,replay=EP][,http=URL][,kind=kvroute|vllm][,block_size=N]"
        "[,topic=T][,server_key=FILE] (repeatable)",
    )
    register.add_argument(
        "--config", help="JSON file: a list of {worker_id, events_endpoint, ...} objects"
    )
    unregister = sub.add_parser(
        "unregister",
        parents=[common],
        help="remove worker registrations",
        description="Remove worker registrations; their entries leave when their lease lapses.",
    )
    unregister.add_argument("worker_ids", nargs="+", metavar="ID", help="worker ids to remove")
    sub.add_parser(
        "workers",
        parents=[common],
        help="list registered workers, their lease holders and owners",
        description="List the registered workers, their endpoints, lease holders (token "
        "'<epoch>:<router>'; '<epoch>:' when a router that shut down parked it for whichever "
        "router takes it next) and owners (the live router that should ingest each one, by "
        "rendezvous hashing over the routers' heartbeats).",
    )
    return parser


def _targets(specs: Sequence[str]) -> list[tuple[WorkerId, str]]:
    out = []
    for spec in specs:
        worker_id, sep, url = spec.partition("=")
        if not sep or not worker_id or not url:
            raise RouterError(f"--worker {spec!r}: expected ID=HTTP_URL")
        out.append((WorkerId(worker_id), url))
    return out


async def _run(args: argparse.Namespace) -> int:
    client = await connect(args.redis, RedisOptions(tls_ca_file=args.tls_ca))
    if args.action == "stats" and args.namespace is None:
        try:
            return await _all_stats(client, args)
        finally:
            await client.aclose()
    layout = KeyLayout(args.namespace or "default")
    try:
        if args.action == "stats":
            stats = await RedisPrefixIndex(client, layout).stats()
            if args.json:
                print(json.dumps(asdict(stats)))
            else:
                print(f"namespace      {args.namespace} on {redact_url(args.redis)}")
                print(f"entries        {stats.num_entries}")
                print(f"keys           {stats.num_keys}")
                print(f"workers        {stats.num_workers}")
                print(f"redis memory   {stats.memory_bytes} bytes (whole server)")
                print(f"memory/entry   {_per_entry(stats)}")
            return 0
        if args.action in ("register", "unregister", "workers"):
            return await _registry_action(args, WorkerRegistry(client, layout))
        return await _check(args, client, layout)
    finally:
        await client.aclose()


async def _check(args: argparse.Namespace, client: RedisClient, layout: KeyLayout) -> int:
    """``kvroute index check``: the index against workers' snapshots, and with
    ``--router`` each worker's routing accuracy; the exit code."""
    index = RedisPrefixIndex(client, layout)
    targets = _targets(args.worker)
    if not targets:
        records = await WorkerRegistry(client, layout).records()
        targets = [(r.worker_id, r.http_url) for r in records if r.has_snapshot and r.http_url]
    if not targets and args.router is None:
        raise RouterError("no kvroute worker to check: pass --worker ID=HTTP_URL")
    try:
        key = load_sent_key(WORKER_ADMIN_KEY, args.worker_admin_key, args.worker_admin_key_file)
    except AuthKeyError as exc:
        raise RouterError(str(exc)) from None
    headers = {} if key is None else {"Authorization": key.authorization}
    async with aiohttp.ClientSession(headers=headers) as workers:
        registry = WorkerRegistry(client, layout)
        checks = await check_workers(index, RouterKeyer(args.seed), workers, targets, registry)
    async with aiohttp.ClientSession() as session:
        accuracy = {} if args.router is None else await _router_accuracy(session, args.router)
    low = sorted(
        w for w, a in accuracy.items()
        if a.ratio is not None and a.ratio < args.accuracy_warn_below_ratio
    )  # fmt: skip
    if args.json:
        print(json.dumps(_check_rows(checks, accuracy, args.router is not None, low)))
    else:
        _print_checks(checks)
        if args.router is not None:
            _print_accuracy(args.router, accuracy, low)
    failed = any(c.num_divergent or c.block_size_mismatch for c in checks) or bool(low)
    return 1 if failed else 0


async def _router_accuracy(
    session: aiohttp.ClientSession, router_url: str
) -> dict[str, ReportedAccuracy]:
    url = router_url.rstrip("/") + "/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                raise RouterError(f"--router {router_url}: GET /metrics answered {resp.status}")
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise RouterError(f"--router {router_url}: cannot read /metrics: {exc}") from exc
    return parse_router_accuracy(text)


def _check_rows(
    checks: Sequence[WorkerCheck],
    accuracy: dict[str, ReportedAccuracy],
    with_router: bool,
    low: Sequence[str],
) -> list[dict[str, object]]:
    """One JSON object per worker: its index check (``null`` fields for a worker only the
    router reports) and, with ``--router``, its ``routing_accuracy``."""
    fields = [f.name for f in dataclasses.fields(WorkerCheck)][1:]
    rows: dict[str, dict[str, object]] = {}
    for c in checks:
        rows[c.worker_id] = asdict(c) | {
            "num_divergent": c.num_divergent, "block_size_mismatch": c.block_size_mismatch,
        }  # fmt: skip
    if with_router:
        for worker in accuracy.keys() - rows.keys():
            rows[worker] = {"worker_id": worker, **dict.fromkeys(fields), "num_divergent": None,
                            "block_size_mismatch": None}  # fmt: skip
        for worker, row in rows.items():
            figures = accuracy.get(worker)
            row["routing_accuracy"] = None if figures is None else asdict(figures) | {
                "low": worker in low
            }  # fmt: skip
    return [rows[w] for w in sorted(rows)] if with_router else list(rows.values())


def _print_checks(checks: Sequence[WorkerCheck]) -> None:
    if not checks:
        return
    print(f"{'worker':<20} {'expected':>9} {'indexed':>9} {'missing':>8} {'extra':>8} "
          f"{'tier':>6}  block size")  # fmt: skip
    for c in checks:
        sizes = "-" if c.registered_block_size is None else str(c.registered_block_size)
        if c.block_size_mismatch:
            sizes += f" (events: {c.events_block_size}; mismatch)"
        print(
            f"{c.worker_id:<20} {c.num_expected:>9} {c.num_indexed:>9} "
            f"{c.num_missing:>8} {c.num_extra:>8} {c.num_tier_mismatch:>6}  {sizes}"
        )
    total = sum(c.num_divergent for c in checks)
    mismatched = sum(c.block_size_mismatch for c in checks)
    print(f"{total} divergent entries, {mismatched} block size mismatches")


def _print_accuracy(
    router_url: str, accuracy: dict[str, ReportedAccuracy], low: Sequence[str]
) -> None:
    print(f"routing accuracy at {router_url} (cached prompt tokens the router expected "
          "against those each worker reported; accuracy over its last requests)")  # fmt: skip
    if not accuracy:
        print("no figures yet: the router has served no request that reported its hits")
        return
    print(f"{'worker':<20} {'expected':>12} {'reported':>12} {'accuracy':>9}")
    for worker, a in accuracy.items():
        ratio = "-" if a.ratio is None else f"{a.ratio:.2f}"
        flag = "  low: see the router's warning for likely causes" if worker in low else ""
        print(
            f"{worker:<20} {a.expected_cached_tokens:>12,} {a.reported_cached_tokens:>12,} "
            f"{ratio:>9}{flag}"
        )
    print(f"workers below the accuracy threshold: {len(low)}")


def _per_entry(stats: IndexStats) -> str:
    """Server memory over the namespace's entries: an upper bound (other namespaces and
    Redis's own overhead count too), meaningless without entries."""
    if not stats.num_entries:
        return "n/a (no entries)"
    if stats.memory_bytes is None:
        return "n/a (memory unknown)"
    return f"at most {stats.memory_bytes / stats.num_entries:.1f} bytes (whole server / entries)"


async def _namespaces(client: RedisClient) -> list[str]:
    """Every namespace with a marker key on the server (one keyspace scan per marker)."""
    found: set[str] = set()
    for marker in NAMESPACE_MARKERS:
        async for key in client.scan_iter(match=f"kvroute:*:{marker}", count=1000):
            namespace = namespace_of(reply_bytes(key).decode(errors="replace"))
            if namespace is not None:
                found.add(namespace)
    return sorted(found)


async def _all_stats(client: RedisClient, args: argparse.Namespace) -> int:
    """``kvroute index stats`` without ``--namespace``: one line per namespace found."""
    rows = []
    for namespace in await _namespaces(client):
        stats = await RedisPrefixIndex(client, KeyLayout(namespace)).stats()
        rows.append((namespace, stats))
    if args.json:
        print(json.dumps({"namespaces": {ns: asdict(stats) for ns, stats in rows}}))
        return 0
    where = redact_url(args.redis)
    if not rows:
        print(f"no kvroute namespace on {where} (nothing registered or indexed yet)")
        return 0
    width = max(len("namespace"), *(len(ns) for ns, _ in rows))
    print(f"{len(rows)} namespace(s) on {where}; --namespace NS for one namespace's details")
    print(f"{'namespace':<{width}} {'entries':>10} {'keys':>10} {'workers':>8}")
    for namespace, stats in rows:
        print(
            f"{namespace:<{width}} {stats.num_entries:>10} {stats.num_keys:>10} "
            f"{stats.num_workers:>8}"
        )
    return 0


async def _registry_action(args: argparse.Namespace, registry: WorkerRegistry) -> int:
    if args.action == "register":
        records = [parse_worker_spec(spec) for spec in args.worker]
        if args.config:
            records += load_records(args.config)
        if not records:
            raise RouterError("nothing to register: pass --worker SPEC or --config FILE")
        refused = []
        for record in records:
            try:
                await registry.save(record, replace=args.replace)
            except RegistrationConflict as exc:
                refused.append(exc)
                print(f"kvroute index: {exc}; pass --replace to replace it", file=sys.stderr)
        print(f"registered {len(records) - len(refused)} worker(s)")
        return 1 if refused else 0
    if args.action == "unregister":
        missing = [w for w in args.worker_ids if not await registry.unregister(WorkerId(w))]
        for worker_id in missing:
            print(f"kvroute index: worker {worker_id!r} was not registered", file=sys.stderr)
        return 1 if missing else 0
    records = await registry.records()
    routers = await registry.live_routers()
    rows = [msgspec.to_builtins(r) for r in records]
    for row in rows:
        row["lease"] = await registry.holder(WorkerId(row["worker_id"]))
        row["owner"] = owner_of(row["worker_id"], routers)
    if args.json:
        print(json.dumps(rows))
        return 0
    for record, row in zip(records, rows, strict=True):
        print(
            f"{record.worker_id:<20} {record.kind:<8} events={record.events_endpoint} "
            f"replay={record.replay_endpoint or '-'} http={record.http_url or '-'} "
            f"block_size={record.block_size} lease={row['lease'] or '-'} "
            f"owner={row['owner'] or '-'}"
        )
    return 0


def main(argv: list[str]) -> int:
    """Run ``kvroute index ACTION ...``; returns the exit code (2 on errors)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(_run(args))
    except RouterError as exc:
        print(f"kvroute index: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
