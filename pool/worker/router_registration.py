"""A worker registering itself with a router: ``PUT /v1/workers/{id}``, ``DELETE`` on drain.

The body is the router's ``POST``/``PUT /v1/workers`` body, built from the worker's
advertised addresses (:mod:`pool.worker.addresses`), never its bind addresses: the router
connects to what it is given and refuses a wildcard. ``PUT`` registers or replaces, so a
worker that comes back at a new address takes its id over. A router that cannot be reached
or answers 5xx/408/429 is asked again with a doubling delay (a router starting after its
workers is normal in a cluster); any other answer is final, and the worker stops with the
router's own message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

import aiohttp

from events.auth import SentKey
from pool.errors import PoolError
from pool.worker.addresses import WorkerAddresses

__all__ = ["RegistrationRefusedError", "RouterRegistration", "registration_body"]

logger = logging.getLogger("kvroute.worker.registration")

_RETRIED_STATUSES: Final = frozenset({408, 429})
_FIRST_DELAY_S: Final = 0.5


class RegistrationRefusedError(PoolError):
    """The router answered the registration with a final refusal (a 4xx)."""


def registration_body(
    worker_id: str,
    addresses: WorkerAddresses,
    *,
    topic: str,
    block_size: int,
    models: tuple[str, ...],
    server_key: str | None,
) -> dict[str, Any]:
    """The ``PUT /v1/workers/{id}`` body announcing a worker at ``addresses``.

    Raises:
        RegistrationRefusedError: The worker publishes no events (the router needs them),
            or an address still names a wildcard host (set ``--advertise-host``).
    """
    if addresses.events is None:
        raise RegistrationRefusedError(
            "--register-url needs the worker's events (--events): a router only takes "
            "workers whose KV events it can subscribe to"
        )
    wildcards = addresses.wildcards
    if wildcards:
        raise RegistrationRefusedError(
            f"cannot register {', '.join(wildcards)} with a router: a wildcard is a bind "
            "address nobody can connect to; set --advertise-host to the host name or IP "
            "other machines reach this worker at"
        )
    body: dict[str, Any] = {
        "worker_id": worker_id,
        "url": addresses.http,
        "events": addresses.events,
        "replay": addresses.replay,
        "topic": topic,
        "block_size": block_size,
        "models": list(models),
    }
    if server_key is not None:
        body["server_key"] = server_key
    return body


@dataclass(frozen=True)
class RouterRegistration:
    """One worker's registration with one router.

    Attributes:
        router_url: The router's base URL (``http://router:8000``).
        body: What :func:`registration_body` built.
        key: The router's admin key, sent as ``Authorization: Bearer``; ``None``: none.
        timeout_s: Bound of one HTTP exchange.
        max_delay_s: Longest delay between two attempts.
    """

    router_url: str
    body: dict[str, Any]
    key: SentKey | None = None
    timeout_s: float = 10.0
    max_delay_s: float = 10.0

    @property
    def url(self) -> str:
        """``{router}/v1/workers/{id}``."""
        worker_id = quote(str(self.body["worker_id"]), safe="")
        return f"{self.router_url.rstrip('/')}/v1/workers/{worker_id}"

    def _session(self) -> aiohttp.ClientSession:
        headers = {} if self.key is None else {"Authorization": self.key.authorization}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        return aiohttp.ClientSession(headers=headers, timeout=timeout)

    async def register(self, stop: asyncio.Event) -> bool:
        """``PUT`` the registration until the router takes it, or until ``stop`` is set.

        Returns:
            True once registered; False if ``stop`` was set first.

        Raises:
            RegistrationRefusedError: The router refused it (a 4xx other than 408/429);
                the message is the router's.
        """
        delay_s = _FIRST_DELAY_S
        async with self._session() as session:
            while not stop.is_set():
                reason = await self._put(session)
                if reason is None:
                    logger.info("registered with the router at %s as %s", self.url, self.body)
                    return True
                logger.warning(
                    "cannot register with the router at %s yet (%s); retrying in %.1f s",
                    self.url,
                    reason,
                    delay_s,
                )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay_s)
                delay_s = min(2 * delay_s, self.max_delay_s)
        return False

    async def _put(self, session: aiohttp.ClientSession) -> str | None:
        """One attempt: ``None`` when registered, else why it is worth another try."""
        try:
            async with session.put(self.url, json=self.body) as resp:
                if resp.status in (200, 201):
                    return None
                message = _error_message(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return str(exc) or type(exc).__name__
        if resp.status < 500 and resp.status not in _RETRIED_STATUSES:
            raise RegistrationRefusedError(
                f"the router at {self.url} refused this worker ({resp.status}): {message}"
            )
        return f"{resp.status}: {message}"

    async def deregister(self) -> None:
        """``DELETE`` the registration, once; a failure is logged, never raised."""
        try:
            async with self._session() as session, session.delete(self.url) as resp:
                outcome = f"{resp.status}: {_error_message(await resp.text())}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            outcome = f"failed: {exc or type(exc).__name__}"
        logger.info("deregistered from the router at %s (%s)", self.url, outcome)


def _error_message(text: str) -> str:
    """The ``error.message`` of a JSON error answer, else the text itself (shortened)."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:300]
    return str(message)
