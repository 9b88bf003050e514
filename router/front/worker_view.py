"""The registered workers as routing reads them, rebuilt only when they change.

Every request needs the registered workers with an HTTP URL, those serving its model, and
those grouped by block size for keying; rebuilding these per request costs O(workers)
(several microseconds per worker: ~5 ms a request at 1,000 workers, ``bench_router``).
:class:`WorkerView` keeps them until the worker set or a worker's models change: the
service calls :meth:`WorkerView.changed` whenever it changes its records, and the models'
:attr:`router.workers.models.WorkerModels.version` says when a model list changed.

NOTE: the lists handed out are shared between requests and must not be mutated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from events.identity import WorkerId
from router.routing.request_keys import BlockSizeGroups, group_by_block_size
from router.workers.models import WorkerModels
from router.workers.registry import WorkerRecord

__all__ = ["CandidateSet", "WorkerView"]

_MAX_SELECTIONS: Final = 64
"""Models whose candidates are kept at once."""


@dataclass(frozen=True, slots=True)
class CandidateSet:
    """Workers a request may go to, with what keying and forwarding need of them.

    Attributes:
        records: The workers, sorted by id.
        worker_ids: Their ids, in the same order.
        by_id: Id -> record.
        positions: Id -> its index in ``worker_ids``.
        groups: The workers grouped by block size (:mod:`router.routing.request_keys`).
    """

    records: Sequence[WorkerRecord]
    worker_ids: Sequence[WorkerId]
    by_id: Mapping[WorkerId, WorkerRecord]
    positions: Mapping[WorkerId, int]
    groups: BlockSizeGroups

    @classmethod
    def of(cls, records: Sequence[WorkerRecord]) -> CandidateSet:
        """The set of ``records`` (not empty), in the order given."""
        ids = [r.worker_id for r in records]
        by_id = dict(zip(ids, records, strict=True))
        positions = dict(zip(ids, range(len(ids)), strict=True))
        return cls(records, ids, by_id, positions, group_by_block_size(records))


class WorkerView:
    """Sorted, proxied and per-model views of a service's worker records, cached.

    Args:
        records: The service's records (worker id -> record); read, never written.
        models: The workers' models.
    """

    def __init__(self, records: Mapping[WorkerId, WorkerRecord], models: WorkerModels) -> None:
        self._records = records
        self._models = models
        self._sorted: list[WorkerRecord] | None = None
        self._proxied: list[WorkerRecord] | None = None
        # NOTE: model asked for -> (model, its candidates); valid for _models_version.
        self._selected: dict[str | None, tuple[str | None, CandidateSet]] = {}
        self._models_version = models.version

    def changed(self) -> None:
        """The records changed: forget every view."""
        self._sorted = self._proxied = None
        self._selected.clear()

    @property
    def sorted(self) -> list[WorkerRecord]:
        """Every record, sorted by worker id."""
        if self._sorted is None:
            self._sorted = [self._records[w] for w in sorted(self._records)]
        return self._sorted

    @property
    def proxied(self) -> list[WorkerRecord]:
        """The records with an HTTP URL (events-only ones: nowhere to proxy), sorted."""
        if self._proxied is None:
            self._proxied = [r for r in self.sorted if r.http_url]
        return self._proxied

    def select(self, model: str | None) -> tuple[str | None, CandidateSet]:
        """:meth:`router.workers.models.WorkerModels.select` over :attr:`proxied` (not
        empty), cached until the records or the models change.

        Raises:
            router.workers.models.ModelNotFoundError: No worker serves ``model``.
            router.workers.models.ModelRequiredError: ``model`` is ``None`` and several
                models are served.
        """
        if self._models.version != self._models_version:
            self._models_version = self._models.version
            self._selected.clear()
        found = self._selected.get(model)
        if found is None:
            if len(self._selected) >= _MAX_SELECTIONS:  # clients name models at will
                self._selected.clear()
            name, records = self._models.select(self.proxied, model)
            found = self._selected[model] = (name, CandidateSet.of(records))
        return found
