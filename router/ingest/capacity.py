"""How many workers one router process can ingest: file descriptors and sockets per worker.

Each worker costs the router a few file descriptors: its SUB socket (an eventfd mailbox
and a TCP connection), its connection monitor (two sockets, two eventfds), a DEALER and
its connection while it replays, and the
HTTP connections kept alive to it (load reports, lifetimes, proxied requests).
:func:`raise_fd_limit` lifts the process's soft ``RLIMIT_NOFILE`` to its hard limit at
router start (a common default soft limit of 1,024 would stop a router at ~170 workers),
and :class:`FleetCapacity` turns what it got into a number of workers, so the router
refuses a worker beyond it with a clear error instead of failing halfway through its
subscription with "Too many open files".
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from typing import Final

from router.errors import RouterError

__all__ = [
    "FDS_PER_WORKER",
    "RESERVED_FDS",
    "SOCKETS_PER_WORKER",
    "CapacityError",
    "FleetCapacity",
    "fd_limit",
    "raise_fd_limit",
]

log = logging.getLogger(__name__)

FDS_PER_WORKER: Final = 8
"""File descriptors budgeted per worker: SUB (2), monitor (2), a replay (2), HTTP (2)."""
RESERVED_FDS: Final = 512
"""File descriptors kept for everything that is not per worker: Redis pools, the HTTP
server's clients, logs, the interpreter."""
SOCKETS_PER_WORKER: Final = 4
"""ZeroMQ sockets per worker at most: SUB, the monitor pair, a replay DEALER."""


class CapacityError(RouterError):
    """This router cannot take another worker: it would run out of file descriptors or
    ZeroMQ sockets."""


@dataclass(frozen=True, slots=True)
class FleetCapacity:
    """The most workers one router process can ingest.

    Attributes:
        fd_limit: The process's soft ``RLIMIT_NOFILE``.
        max_sockets: The ZeroMQ context's socket limit for event streams.
    """

    fd_limit: int
    max_sockets: int

    @property
    def max_workers(self) -> int:
        """Workers that fit in both budgets."""
        by_fds = (self.fd_limit - RESERVED_FDS) // FDS_PER_WORKER
        return max(0, min(by_fds, self.max_sockets // SOCKETS_PER_WORKER))

    def check(self, num_workers: int) -> None:
        """Refuse ``num_workers`` if they do not fit.

        Raises:
            CapacityError: Says how many fit and which limit to raise.
        """
        if num_workers <= self.max_workers:
            return
        raise CapacityError(
            f"this router can ingest at most {self.max_workers} workers, {num_workers} "
            f"asked for (file descriptor limit {self.fd_limit}, {FDS_PER_WORKER} per worker "
            f"and {RESERVED_FDS} reserved; {self.max_sockets} ZeroMQ sockets, "
            f"{SOCKETS_PER_WORKER} per worker): raise the limit (ulimit -n, or LimitNOFILE= "
            "/ the container's nofile ulimit) or spread the workers over more routers"
        )


def fd_limit() -> int:
    """The process's soft ``RLIMIT_NOFILE`` now."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (logged); returns the soft limit
    now in force (unchanged when it is already the hard limit or cannot be raised)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the file descriptor limit from %d to %d: %s", soft, hard, exc)
        return soft
    log.info("file descriptor limit raised from %d to %d (the hard limit)", soft, hard)
    return hard
