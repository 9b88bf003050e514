"""Who may call which router endpoint: bearer keys per endpoint group, JSON-only bodies.

Endpoint groups of the router's HTTP API:

* **admin** (``--admin-key``): ``GET``/``POST /v1/workers``, ``PUT``/``DELETE
  /v1/workers/{id}``. Registering a worker decides where prompts go (a rogue worker
  would receive them, ``Authorization`` headers included), and the list reveals the
  cluster's addresses.
* **inference** (``--api-key``): ``POST /v1/completions``, ``/v1/chat/completions``,
  ``/v1/route``; the admin key is accepted there too.
* **open**: ``GET /health`` and ``GET /metrics``.

A group without a key is open (the default, with the router on loopback). A request
presents a key as ``Authorization: Bearer KEY`` (:class:`events.auth.BearerKey`, compared
in constant time); a missing or wrong one is a 401 that changes nothing. ``POST`` and
``PUT`` bodies must be sent as ``Content-Type: application/json`` (415 otherwise): a web
page can make a browser send a cross-site ``text/plain`` or form POST without asking
first, but not a JSON one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from events.auth import BearerKey, challenge, is_loopback
from events.rate_limited_log import RateLimitedLog
from router.errors import RouterError

__all__ = [
    "ADMIN_ENDPOINTS",
    "INFERENCE_ENDPOINTS",
    "AccessError",
    "Guard",
    "exposure_warning",
]

logger = logging.getLogger(__name__)

ADMIN_ENDPOINTS: Final = "GET/POST /v1/workers, PUT/DELETE /v1/workers/{id}"
INFERENCE_ENDPOINTS: Final = "POST /v1/completions, /v1/chat/completions, /v1/route, GET /v1/models"
_BODY_METHODS: Final = frozenset({"POST", "PUT"})
_REFUSAL_LOG_INTERVAL_S: Final = 60.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AccessError(RouterError):
    """A request is refused before its handler runs (401 or 415).

    Attributes:
        status: The HTTP status.
        kind: The error ``type`` of the JSON answer.
        headers: Headers of the answer (``WWW-Authenticate`` on a 401).
    """

    def __init__(
        self, status: int, message: str, kind: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers or {}


class Guard:
    """Wraps the handlers of one endpoint group: its keys, then the JSON-only rule.

    Args:
        group: The group's name in messages (``"admin"``, ``"inference"``).
        flag: The flag that sets its key (named in a 401's message).
        keys: Keys accepted; none (all ``None``): the group is open.
    """

    def __init__(self, group: str, flag: str, *keys: BearerKey | None) -> None:
        self.group = group
        self.flag = flag
        self._keys = tuple(k for k in keys if k is not None)
        self._refusals = RateLimitedLog(_REFUSAL_LOG_INTERVAL_S, logger)

    @property
    def is_open(self) -> bool:
        """True when no key guards the group."""
        return not self._keys

    def __call__(self, handler: Handler) -> Handler:
        """``handler`` behind this group's checks."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            self.check(request)
            return await handler(request)

        return guarded

    def check(self, request: web.Request) -> None:
        """Refuse ``request`` unless it presents a key of the group and, with a body, JSON.

        Raises:
            AccessError: 401 without a valid key, 415 for a non-JSON body.
        """
        header = request.headers.get("Authorization")
        if self._keys and not any(key.accepts(header) for key in self._keys):
            peer = request.remote or "?"
            self._refusals.warning(
                (self.group, peer),
                "refused %s %s from %s: %s bearer token",
                request.method, request.path, peer, "no" if header is None else "a wrong",
            )  # fmt: skip
            raise AccessError(
                401,
                f"{request.method} {request.path} needs the router's {self.group} key: send "
                f"'Authorization: Bearer KEY' with the key of {self.flag}",
                "authentication_error",
                {"WWW-Authenticate": challenge(header)},
            )
        if request.method in _BODY_METHODS and request.content_type != "application/json":
            raise AccessError(
                415,
                f"Content-Type must be application/json, got {request.content_type!r} "
                "(with curl: -H 'Content-Type: application/json')",
                "invalid_request_error",
            )


def exposure_warning(host: str, admin: Guard, inference: Guard) -> str | None:
    """The warning for a router listening beyond loopback with open groups (None: none).

    Names exactly what anyone who can reach ``host`` may do without a key.
    """
    if is_loopback(host):
        return None
    exposed = []
    if admin.is_open:
        exposed.append(
            f"register, replace, remove and list workers ({ADMIN_ENDPOINTS}; a worker "
            "registered by a stranger receives the prompts routed to it) [--admin-key]"
        )
    if inference.is_open:
        exposed.append(f"send requests to the workers ({INFERENCE_ENDPOINTS}) [--api-key]")
    if not exposed:
        return None
    return (
        f"listening on {host}, reachable from other machines, and anyone who reaches it "
        f"can: {'; '.join(exposed)}. Set the keys in brackets (or their -file / "
        "$KVROUTE_* forms) to require a bearer token"
    )
