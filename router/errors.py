"""Error hierarchy of the ``router`` package."""

from __future__ import annotations

from events.identity import WorkerId

__all__ = ["OrphanParentError", "PrefixIndexError", "RouterError"]


class RouterError(Exception):
    """Base of every error raised by the ``router`` package."""


class PrefixIndexError(RouterError):
    """The prefix index could not apply or answer an operation."""


class OrphanParentError(PrefixIndexError):
    """A ``BlockStored`` chains from a parent hash the index does not know for that worker.

    The field's common defect is to drop such events silently; kvroute raises so the
    ingest layer can ask for replay or resync the worker.

    Attributes:
        worker_id: The worker whose event it was.
        parent_hash: The unknown parent engine hash, as it came on the wire.
        num_applied: How many events of the batch were applied before this one.
    """

    def __init__(self, worker_id: WorkerId, parent_hash: int | bytes, num_applied: int) -> None:
        super().__init__(
            f"worker {worker_id!r}: BlockStored parent {parent_hash!r} is unknown to the "
            f"index ({num_applied} earlier events of the batch were applied); "
            "replay or resync this worker"
        )
        self.worker_id = worker_id
        self.parent_hash = parent_hash
        self.num_applied = num_applied
