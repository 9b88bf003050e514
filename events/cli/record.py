"""``kvroute record``: append every worker's KV event batches, after gap recovery, to a log."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from events.cli.streams import (
    add_subscriber_arguments,
    configure_logging,
    run_until_stopped,
    subscriber_settings,
)
from events.curve import CurveKeyError
from events.recorder import EventLogError, EventLogWriter, EventRecorder
from events.subscriber import SubscriberConfig, WorkerStream

__all__ = ["main"]

_log = logging.getLogger("kvroute.record")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute record",
        description="Subscribe to workers' KV event streams and append every batch (after "
        "gap recovery), reset and resync to an event log, until SIGINT or SIGTERM. Read the "
        "log with `kvroute events dump`.",
    )
    add_subscriber_arguments(parser)
    parser.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="event log to append to (created if missing; a torn last record is cut off)",
    )
    parser.add_argument(
        "--flush-interval-s",
        type=float,
        default=1.0,
        help="how often buffered records are handed to the OS, so readers see them "
        "(default: %(default)s); the log is fsynced on exit",
    )
    return parser


async def _record(
    writer: EventLogWriter,
    config: SubscriberConfig,
    streams: list[WorkerStream],
    flush_interval_s: float,
) -> None:
    async def flush_periodically() -> None:
        while True:
            await asyncio.sleep(flush_interval_s)
            writer.flush()

    flusher = asyncio.create_task(flush_periodically())
    try:
        await run_until_stopped(EventRecorder(writer), config, streams)
    finally:
        flusher.cancel()


def main(argv: list[str]) -> int:
    """Run ``kvroute record``; returns the exit code."""
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        config, streams = subscriber_settings(args)
        writer = EventLogWriter(args.out)
    except (ValueError, CurveKeyError, EventLogError, OSError) as exc:
        _log.error("%s", exc)
        return 2
    _log.info("recording %s to %s", ", ".join(s.worker_id for s in streams), writer.path)
    try:
        try:
            asyncio.run(_record(writer, config, streams, args.flush_interval_s))
        finally:
            writer.close()
    except OSError as exc:  # the log cannot be written (disk full, ...)
        _log.error("recording stopped: %s", exc)
        return 1
    _log.info("wrote %d records to %s", writer.num_records, writer.path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
