"""Progress of a long command on stderr: a bar on a terminal, periodic log lines elsewhere.

On a terminal, :func:`progress` shows a tqdm bar and routes the console's log records
through it, so a log line prints above the bar instead of into it. Anywhere else (CI,
a pipe, a file) a bar is unreadable, so a log line states the progress every
``interval_s`` instead, stalled or not. Either way the display ends when the block ends:
on an error or Ctrl-C the bar is erased before the caller reports it, never left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Final, Literal

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

__all__ = ["DEFAULT_INTERVAL_S", "Progress", "add_progress_arguments", "progress", "progress_of"]

DEFAULT_INTERVAL_S: Final = 10.0
"""Seconds between two progress lines when stderr is not a terminal."""

Mode = Literal["bar", "lines", "off"]


class Progress:
    """Counts finished items of one run and shows them (see :func:`progress`).

    NOTE: :meth:`update` may run on another thread than the one printing lines; a count
    read a moment late is harmless.
    """

    def __init__(
        self, total: int, *, unit: str, mode: Mode, interval_s: float, logger: logging.Logger
    ) -> None:
        self.total = total
        self.count = 0
        self.description = ""
        self._unit = unit
        self._logger = logger
        self._started_s = time.monotonic()
        self._bar: Any = tqdm(total=total, unit=unit, file=sys.stderr) if mode == "bar" else None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if mode == "lines":
            self._ticker = threading.Thread(
                target=self._tick, args=(interval_s,), name="progress", daemon=True
            )
            self._ticker.start()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more finished items."""
        self.count += n
        if self._bar is not None:
            self._bar.update(n)

    def set_description(self, text: str) -> None:
        """Name what is running now (e.g. the policy), shown before the count."""
        self.description = text
        if self._bar is not None:
            self._bar.set_description(text, refresh=False)

    def line(self) -> str:
        """The progress as one line: what runs, the count, the share and the rate."""
        elapsed_s = max(time.monotonic() - self._started_s, 1e-9)
        share = self.count / self.total if self.total else 1.0
        prefix = f"{self.description}: " if self.description else ""
        return (
            f"{prefix}{self.count}/{self.total} {self._unit} ({share:.0%}), "
            f"{self.count / elapsed_s:.1f} {self._unit}/s, {elapsed_s:.0f} s elapsed"
        )

    def _tick(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._logger.info("progress: %s", self.line())

    def close(self, *, erase: bool) -> None:
        """End the display; ``erase`` wipes the bar (after an error, before it is reported)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._bar is not None:
            if erase:
                self._bar.leave = False
            self._bar.close()


@contextlib.contextmanager
def progress(
    total: int,
    *,
    unit: str,
    logger: logging.Logger,
    enabled: bool = True,
    interval_s: float = DEFAULT_INTERVAL_S,
) -> Iterator[Progress]:
    """Show the progress of the enclosed block on stderr.

    Args:
        total: Items the block will finish.
        unit: What an item is, e.g. ``"req"``.
        logger: Where progress lines go when stderr is not a terminal.
        enabled: ``False`` shows nothing (``--no-progress``).
        interval_s: Seconds between progress lines when stderr is not a terminal.

    Yields:
        The :class:`Progress` to advance.
    """
    mode: Mode = "off" if not enabled else ("bar" if sys.stderr.isatty() else "lines")
    shown = Progress(total, unit=unit, mode=mode, interval_s=interval_s, logger=logger)
    redirect = logging_redirect_tqdm() if mode == "bar" else contextlib.nullcontext()
    with redirect:
        try:
            yield shown
        except BaseException:
            shown.close(erase=True)
            raise
        shown.close(erase=False)


def add_progress_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--no-progress`` and ``--progress-interval-s`` (read by :func:`progress_of`)."""
    parser.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    parser.add_argument(
        "--progress-interval-s",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between progress lines when stderr is not a terminal (default: "
        "%(default)s; on a terminal a progress bar)",
    )


def progress_of(
    args: argparse.Namespace, total: int, *, unit: str, logger: logging.Logger
) -> contextlib.AbstractContextManager[Progress]:
    """:func:`progress` as the flags of :func:`add_progress_arguments` ask."""
    return progress(
        total,
        unit=unit,
        logger=logger,
        enabled=not args.no_progress,
        interval_s=args.progress_interval_s,
    )
