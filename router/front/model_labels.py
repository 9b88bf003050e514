"""The ``model`` label of request metrics, with a bounded set of values.

A request's ``model`` field is client text: used as a label as is, a client could create
one time series per request. The label is the request's ``model`` only when the router
knows that model: one that a worker served (the ``model`` of a worker's successful
answer), or one a caller declared (model routing, configuration). Any other model is
``"other"``, a request without one ``"unknown"``. At most ``max_models`` are learned;
past them new names are ``"other"`` too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from events.request_ids import printable_id

__all__ = ["OTHER_MODEL", "UNKNOWN_MODEL", "ModelLabels"]

UNKNOWN_MODEL: Final = "unknown"
"""The label of a request without a ``model`` field."""
OTHER_MODEL: Final = "other"
"""The label of a request whose model the router does not know."""
_MAX_MODEL_CHARS: Final = 128


class ModelLabels:
    """The models the router knows, and the label of a request's model.

    Args:
        known: Models known from the start.
        max_models: Most models known at once.
    """

    def __init__(self, known: Iterable[str] = (), max_models: int = 32) -> None:
        self.max_models = max_models
        self._known: set[str] = set()
        for name in known:
            self.learn(name)

    @property
    def known(self) -> frozenset[str]:
        """The models known now."""
        return frozenset(self._known)

    def learn(self, model: object) -> None:
        """Know ``model`` from now on (ignored when not a usable name or the set is full)."""
        if not isinstance(model, str) or len(self._known) >= self.max_models:
            return
        name = printable_id(model, _MAX_MODEL_CHARS)
        if name is not None:
            self._known.add(name)

    def label(self, model: object) -> str:
        """The label of a request whose body's ``model`` is ``model`` (``None``: absent)."""
        if model is None:
            return UNKNOWN_MODEL
        return model if isinstance(model, str) and model in self._known else OTHER_MODEL
