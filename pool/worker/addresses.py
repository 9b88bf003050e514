"""Where other hosts reach a worker: its bound addresses, the advertised host put in.

A worker binds its HTTP server and its ZeroMQ sockets to listen addresses (``--host``,
``--events``, ``--replay``); a router *connects* to the addresses the worker announces.
A wildcard bind (``0.0.0.0``, ``::``, ``*``) listens everywhere but reaches nothing, so
``--advertise-host`` names the host others dial (a DNS name such as a compose service or
a Kubernetes pod's, or an IP). Ports always stay the bound ones: the OS-chosen port of
``tcp://HOST:*`` is only known after the bind. ``ipc://`` endpoints stay as they are (they
are reachable on this machine only, under the same path).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

from events.auth import is_wildcard
from pool.errors import PoolError

__all__ = ["AddressError", "WorkerAddresses", "check_advertise_host", "http_url"]

_TCP: Final = re.compile(r"tcp://(\[[^\]]*\]|[^:\[\]]*):([0-9]+|\*)")


class AddressError(PoolError, ValueError):
    """An advertise host is malformed, or a wildcard would be announced where it must not."""


def check_advertise_host(host: str) -> str:
    """Validate ``--advertise-host``: a host name or IP literal that is not a wildcard.

    Returns:
        The host, an IPv6 literal without brackets.

    Raises:
        AddressError: Empty, a wildcard, or has characters no host name has.
    """
    bare = host.strip().removeprefix("[").removesuffix("]")
    if is_wildcard(bare):
        raise AddressError(
            f"--advertise-host {host!r} is a wildcard: it must be the address other hosts "
            "dial to reach this worker (its IP or DNS name, e.g. a service name)"
        )
    if not re.fullmatch(r"[A-Za-z0-9_.:%-]+", bare):
        raise AddressError(f"--advertise-host {host!r} is not a host name or IP address")
    return bare


def http_url(host: str, port: int) -> str:
    """``http://HOST:PORT``, an IPv6 literal in brackets."""
    return f"http://{_url_host(host)}:{port}"


def _url_host(host: str) -> str:
    bare = host.removeprefix("[").removesuffix("]")
    try:
        is_v6 = ipaddress.ip_address(bare).version == 6
    except ValueError:
        is_v6 = False
    return f"[{bare}]" if is_v6 else bare


def _with_host(endpoint: str, host: str) -> str:
    """A bound ``tcp://`` endpoint with its host replaced; other transports unchanged."""
    match = _TCP.fullmatch(endpoint)
    if match is None:
        return endpoint
    return f"tcp://{_url_host(host)}:{match.group(2)}"


def _tcp_host(endpoint: str | None) -> str | None:
    match = _TCP.fullmatch(endpoint or "")
    return None if match is None else match.group(1)


@dataclass(frozen=True)
class WorkerAddresses:
    """A worker's HTTP URL and event endpoints (``None``: not served).

    Attributes:
        http: ``http://HOST:PORT``.
        events: The event PUB endpoint.
        replay: The replay ROUTER endpoint.
    """

    http: str
    events: str | None
    replay: str | None

    @classmethod
    def bound(
        cls, host: str, port: int, events: str | None, replay: str | None
    ) -> WorkerAddresses:
        """The addresses in effect after binding (ports resolved)."""
        return cls(http_url(host, port), events, replay)

    def advertised(self, host: str | None) -> WorkerAddresses:
        """These addresses as others reach them: ``host`` in place of every bound host.

        ``None`` keeps the bound hosts (right when they are specific addresses).
        """
        if host is None:
            return self
        port = self.http.rsplit(":", 1)[1]
        return WorkerAddresses(
            f"http://{_url_host(host)}:{port}",
            None if self.events is None else _with_host(self.events, host),
            None if self.replay is None else _with_host(self.replay, host),
        )

    @property
    def wildcards(self) -> list[str]:
        """The addresses that still name a wildcard host (nobody can dial them)."""
        hosts = [
            (self.http, self.http.removeprefix("http://").rsplit(":", 1)[0]),
            (self.events, _tcp_host(self.events)),
            (self.replay, _tcp_host(self.replay)),
        ]
        return [str(a) for a, h in hosts if h is not None and is_wildcard(h)]

    def as_dict(self) -> dict[str, str | None]:
        """``{"http", "events", "replay"}``, the keys of the worker's ready line."""
        return {"http": self.http, "events": self.events, "replay": self.replay}
