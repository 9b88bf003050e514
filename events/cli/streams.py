"""Command-line plumbing of the commands that subscribe to workers (``record``, ``events tail``).

It parses ``--worker ID=tcp://HOST:PORT[,replay=ADDR][,topic=T][,server_key=FILE]`` specs
and the CURVE and replay flags into :class:`~events.subscriber.WorkerStream` objects, sets
up logging, and runs an :class:`~events.subscriber.EventSubscriber` until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Final

from events.curve import CurveClientConfig, CurveKeyError, CurveKeyPair, load_public_key
from events.identity import WorkerId
from events.subscriber import EventSink, EventSubscriber, SubscriberConfig, WorkerStream

__all__ = [
    "add_subscriber_arguments",
    "configure_logging",
    "parse_worker_spec",
    "run_until_stopped",
    "subscriber_settings",
]

_SPEC_HELP: Final = (
    "a worker to subscribe to, repeatable: ID=tcp://HOST:PORT (its PUB address), optionally "
    "followed by ,replay=tcp://HOST:PORT (its replay address; without it gaps cannot be "
    "replayed), ,topic=T (topic prefix) and ,server_key=FILE (its CURVE public key file; "
    "needs --client-key)"
)
_OPTIONS: Final = ("replay", "topic", "server_key")


def parse_worker_spec(text: str, client_keys: CurveKeyPair | None = None) -> WorkerStream:
    """Parse one ``--worker`` value.

    Args:
        text: ``ID=ADDRESS[,replay=ADDRESS][,topic=T][,server_key=FILE]``.
        client_keys: This subscriber's CURVE key pair, required with ``server_key``.

    Raises:
        ValueError: The spec is malformed; the message shows the expected shape.
        CurveKeyError: A ``server_key`` file is unreadable, or no client keys were given.
    """
    head, *rest = text.split(",")
    worker_id, sep, endpoint = head.partition("=")
    if not sep or not worker_id or "://" not in endpoint:
        raise ValueError(f"--worker {text!r}: expected ID=tcp://HOST:PORT[,replay=...][,topic=...]")
    options: dict[str, str] = {}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep or key not in _OPTIONS:
            raise ValueError(
                f"--worker {text!r}: unknown option {item!r}; expected one of "
                f"{', '.join(k + '=...' for k in _OPTIONS)}"
            )
        options[key] = value
    curve = None
    if "server_key" in options:
        if client_keys is None:
            raise CurveKeyError(f"--worker {worker_id}: server_key= needs --client-key")
        curve = CurveClientConfig(load_public_key(options["server_key"]), client_keys)
    return WorkerStream(
        WorkerId(worker_id),
        endpoint,
        replay_endpoint=options.get("replay"),
        topic=options.get("topic", "").encode(),
        curve=curve,
    )


def add_subscriber_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--worker``, ``--client-key``, ``--replay-timeout-s``, ``--replay-deadline-s``
    and ``--log-level``."""
    parser.add_argument("--worker", action="append", required=True, metavar="SPEC", help=_SPEC_HELP)
    parser.add_argument(
        "--client-key",
        default=os.environ.get("KVROUTE_CLIENT_KEY"),
        metavar="FILE",
        help="this subscriber's CURVE secret key file (NAME.key_secret from `kvroute keys`), "
        "presented to workers given with server_key=; env KVROUTE_CLIENT_KEY",
    )
    parser.add_argument(
        "--replay-timeout-s",
        type=float,
        default=SubscriberConfig().replay_timeout_s,
        help="longest silence accepted from a replay endpoint before the worker is "
        "declared in need of a resync (default: %(default)s)",
    )
    parser.add_argument(
        "--replay-deadline-s",
        type=float,
        default=SubscriberConfig().replay_deadline_s,
        help="longest a whole replay may take, however steadily its replies come, before "
        "the worker is declared in need of a resync (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="stderr log level (default: %(default)s)",
    )


def subscriber_settings(args: argparse.Namespace) -> tuple[SubscriberConfig, list[WorkerStream]]:
    """The subscriber config and worker streams named by the parsed arguments.

    Raises:
        ValueError: A ``--worker`` spec is malformed or a worker id repeats.
        CurveKeyError: A key file is unreadable.
    """
    client_keys = CurveKeyPair.load(args.client_key) if args.client_key else None
    streams = [parse_worker_spec(spec, client_keys) for spec in args.worker]
    ids = [s.worker_id for s in streams]
    if len(set(ids)) != len(ids):
        raise ValueError(f"worker ids must be unique, got {ids}")
    # A tool stops on a sink failure (say, its log's disk is full) rather than go on
    # with a hole in what it records.
    config = SubscriberConfig(
        replay_timeout_s=args.replay_timeout_s,
        replay_deadline_s=args.replay_deadline_s,
        on_reader_failure="stop",
    )
    return config, streams


def configure_logging(level: str) -> None:
    """Log to stderr at ``level``."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def run_until_stopped(
    sink: EventSink,
    config: SubscriberConfig,
    streams: list[WorkerStream],
    stop: asyncio.Event | None = None,
) -> None:
    """Subscribe ``sink`` to ``streams`` until SIGINT, SIGTERM or ``stop`` is set.

    Raises:
        Exception: Whatever the sink raised (the subscriber stops on a sink failure).
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    subscriber = EventSubscriber(sink, config)
    try:
        for stream in streams:
            await subscriber.add_worker(stream)
        runner = asyncio.create_task(subscriber.run())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        await subscriber.close()
        await runner
    finally:
        await subscriber.close()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
