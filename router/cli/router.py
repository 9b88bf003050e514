"""``kvroute router``: run one cache-aware router replica from flags and an optional config file.

Settings come from, in increasing priority: defaults, ``--config FILE`` (TOML or JSON,
keys named like the flags with underscores), environment variables ``KVROUTE_REDIS_URL``
and ``KVROUTE_NAMESPACE``, then the flags. Without ``--redis`` an embedded Redis is
started on a free loopback port and stopped on exit. Once serving, one JSON line
``{"router": URL, "redis": URL, "replica_id": ID}`` is printed on stdout; logs go to
stderr. SIGTERM or SIGINT stop the router cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

from events.errors import EventsError
from events.hashing import NATIVE_KEYS
from events.schema import NATIVE_DECODE
from router.cli.event_loop import run_on
from router.cli.router_config import config_from_args, load_config_file
from router.cli.router_flags import build_parser
from router.errors import RouterError
from router.front.access import exposure_warning
from router.front.app import guards
from router.front.service import RouterService
from router.ingest._native.runs import NATIVE_RUNS
from router.store.connection import redact_url
from router.store.server import RedisServer

__all__ = ["main"]

logger = logging.getLogger(__name__)


async def _serve(args: argparse.Namespace) -> int:
    redis_url = args.redis or os.environ.get("KVROUTE_REDIS_URL")
    if redis_url is None and args.config:
        redis_url = load_config_file(args.config).get("redis")
    embedded: RedisServer | None = None
    if redis_url is None:
        embedded = RedisServer().start()
        redis_url = embedded.url
        logger.info("no --redis given: started an embedded Redis at %s", redis_url)
    try:
        config = config_from_args(args, redis_url)
        exposed = exposure_warning(config.host, *guards(config))
        if exposed is not None:
            logger.warning("%s", exposed)
        if config.proxy.forward_authorization and config.proxy.worker_key is not None:
            logger.warning(
                "--forward-authorization with --worker-api-key: workers receive the "
                "--worker-api-key, not the clients' Authorization headers"
            )
        elif config.proxy.forward_authorization and config.api_key is not None:
            logger.warning(
                "--forward-authorization with --api-key: every worker receives the "
                "router's API key in the clients' Authorization headers"
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with await RouterService.open(config) as service:
            if not (NATIVE_KEYS and NATIVE_RUNS and NATIVE_DECODE):
                logger.warning(
                    "kvroute's C modules were not built (no C compiler at install time): "
                    "event decoding, router keys and the index ingest run in Python, slower "
                    "per block; reinstall kvroute where gcc and the Python headers are present"
                )
            # Long-lived startup objects leave the GC's scans: collections triggered by
            # per-request garbage then stay short (bench_router: p50 at 64 workers).
            gc.freeze()
            ready = {"router": service.url, "redis": redact_url(redis_url),
                     "replica_id": service.load.replica_id}  # fmt: skip
            print(json.dumps(ready), flush=True)
            await stop.wait()
            logger.info("stopping the router")
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


def main(argv: Sequence[str]) -> int:
    """Entry point of ``kvroute router``; returns the exit code."""
    args = build_parser().parse_args(list(argv))
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run_on(args.event_loop, _serve(args))
    except (RouterError, EventsError, OSError, ValueError) as exc:
        logger.error("router failed: %s", exc)
        return 1
    except Exception:  # a bug: still exit with its trace rather than hang or die silently
        logger.exception("router failed")
        return 1
