"""Rate-limited warnings: one line per key at most every interval, with a count of the rest.

A stream that goes bad (a wrong CURVE key, a flood of malformed messages) repeats the same
warning per message; logging each would drown the log and cost the event path.
"""

from __future__ import annotations

import collections
import logging
import time

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Logs one warning per key at most every ``interval_s``, counting the suppressed ones.

    Args:
        interval_s: The least time between two warnings of one key.
        logger: Where the warnings go.
    """

    def __init__(self, interval_s: float, logger: logging.Logger) -> None:
        self._interval_s = interval_s
        self._logger = logger
        # NOTE: a key is logged again once monotonic time reaches its entry here.
        self._next_s: dict[tuple[str, str], float] = {}
        self._suppressed: collections.Counter[tuple[str, str]] = collections.Counter()

    def warning(self, key: tuple[str, str], message: str, *args: object) -> None:
        """Log ``message % args`` unless ``key`` was logged less than ``interval_s`` ago."""
        now = time.monotonic()
        if now < self._next_s.get(key, 0.0):
            self._suppressed[key] += 1
            return
        self._next_s[key] = now + self._interval_s
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            message += f" ({suppressed} similar warnings suppressed)"
        self._logger.warning(message, *args)
