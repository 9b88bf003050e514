"""Which models each worker serves, and which workers may take a request for a model.

A worker's models are the ones its registration names (``"models"`` in ``POST
/v1/workers``, ``model=NAME`` in a ``--worker`` spec), else the ones it lists at ``GET
/v1/models`` (a vLLM engine lists its ``--served-model-name`` names and its LoRA adapters;
so does a kvroute worker), polled by :class:`router.workers.reports.WorkerReportPoller`.
Until a worker's list is known (not polled yet, or it answers none) its models are
unknown.

A request for model ``M`` goes to the workers known to serve ``M``; when none does, to the
workers whose models are unknown (their own answer then says whether they serve it);
with neither, it gets OpenAI's 404 ``model_not_found``. A request without ``model`` goes
to every worker when the router knows at most one model (vLLM serves its only model
then); with several it must name one (400).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from events.identity import WorkerId
from router.errors import RouterError
from router.workers.registry import WorkerRecord

__all__ = [
    "MAX_LISTED_MODELS",
    "ModelNotFoundError",
    "ModelRequiredError",
    "WorkerModels",
    "parse_model_list",
]

MAX_LISTED_MODELS: Final = 1024
"""Most entries read from one worker's ``/v1/models`` (the rest are ignored)."""
_MAX_NAME_CHARS: Final = 256


class ModelNotFoundError(RouterError):
    """No worker serves the requested model (OpenAI's 404 ``model_not_found``).

    Attributes:
        model: The model asked for.
    """

    def __init__(self, model: str, served: Sequence[str]) -> None:
        known = ", ".join(served) if served else "none yet"
        super().__init__(
            f"The model `{model}` does not exist. The workers behind this router serve: {known}"
        )
        self.model = model


class ModelRequiredError(RouterError):
    """The request names no model and the router serves several (a 400 on ``model``)."""

    def __init__(self, served: Sequence[str]) -> None:
        super().__init__(
            f"'model' is required: this router serves several models ({', '.join(served)})"
        )


def parse_model_list(body: Any) -> list[dict[str, Any]] | None:
    """The model entries of a ``GET /v1/models`` answer, or ``None`` if it is not one.

    Each entry keeps what the worker said (``id``, ``owned_by``, ``root``, ``parent``,
    ``max_model_len``, ...); entries without a string ``id`` of at most 256 characters
    are dropped, and at most :data:`MAX_LISTED_MODELS` are kept.
    """
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    entries = [
        e
        for e in data[:MAX_LISTED_MODELS]
        if isinstance(e, dict)
        and isinstance(e.get("id"), str)
        and 0 < len(e["id"]) <= _MAX_NAME_CHARS
    ]
    return entries


class WorkerModels:
    """The models of every worker: named in its registration, else learned from it."""

    def __init__(self) -> None:
        # NOTE: worker -> the entries of its last good /v1/models answer.
        self._learned: dict[WorkerId, tuple[dict[str, Any], ...]] = {}
        self._created = int(time.time())
        self._version = 0

    @property
    def version(self) -> int:
        """Changes whenever what is known of a worker's models changes (callers that
        cache :meth:`select` compare it)."""
        return self._version

    def learn(self, worker_id: WorkerId, entries: Sequence[Mapping[str, Any]] | None) -> None:
        """Record what a worker listed (``None``: it answered no list; its models stay
        as they were)."""
        if entries is not None:
            learned = tuple(dict(e) for e in entries)
            if self._learned.get(worker_id) != learned:
                self._learned[worker_id] = learned
                self._version += 1

    def forget(self, worker_id: WorkerId) -> None:
        """Drop what was learned of a worker (unregistered)."""
        if self._learned.pop(worker_id, None) is not None:
            self._version += 1

    def of(self, record: WorkerRecord) -> tuple[str, ...] | None:
        """The models a worker serves, or ``None`` while unknown."""
        if record.models:
            return record.models
        learned = self._learned.get(WorkerId(record.worker_id))
        return None if learned is None else tuple(e["id"] for e in learned)

    def served(self, records: Sequence[WorkerRecord]) -> list[str]:
        """Every model some worker is known to serve, in the workers' order."""
        names: dict[str, None] = {}
        for record in records:
            names.update(dict.fromkeys(self.of(record) or ()))
        return list(names)

    def listing(self, records: Sequence[WorkerRecord]) -> list[dict[str, Any]]:
        """The ``data`` of the router's ``GET /v1/models``: the union of the workers' models
        (one entry per id, as the first worker listing it described it)."""
        entries: dict[str, dict[str, Any]] = {}
        for record in records:
            if record.models:
                for name in record.models:
                    entries.setdefault(name, self._named(name))
                continue
            for entry in self._learned.get(WorkerId(record.worker_id), ()):
                entries.setdefault(entry["id"], entry)
        return list(entries.values())

    def _named(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "kvroute"}

    def select(
        self, records: Sequence[WorkerRecord], model: str | None
    ) -> tuple[str | None, list[WorkerRecord]]:
        """The model a request is for and the workers that may serve it (see the module doc).

        Args:
            records: The workers requests may go to.
            model: The request's ``model``, if it names one.

        Returns:
            The model (the only one served when the request names none and there is
            one; ``None`` when none is known) and the workers, in the order given.

        Raises:
            ModelNotFoundError: No worker serves ``model``, and every worker's models are
                known.
            ModelRequiredError: ``model`` is ``None`` and several models are served.
        """
        served = self.served(records)
        if model is None:
            if len(served) > 1:
                raise ModelRequiredError(served)
            return (served[0] if served else None), list(records)
        known = [r for r in records if model in (self.of(r) or ())]
        if known:
            return model, known
        unknown = [r for r in records if self.of(r) is None]
        if unknown:
            return model, unknown
        raise ModelNotFoundError(model, served)
