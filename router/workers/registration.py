"""Validation of worker registrations: every ``WorkerRecord`` passes one check before use.

Every path that creates a record (``POST``/``PUT /v1/workers``, ``--worker`` flags,
``--config`` files, ``kvroute index register``, records read back from Redis) runs
:func:`check_fields` (the record alone: syntax and ranges; ``WorkerRecord.__post_init__``
calls it, so no record object exists that fails it) and, inside a router,
:meth:`RegistrationPolicy.check` (this router's rules: allowed networks, CURVE required,
not its own address).

The router *connects* to every address of a record, so:

* ZeroMQ endpoints are ``tcp://HOST:PORT`` (port 1-65535, a host name or IP literal,
  IPv6 in brackets; never a wildcard ``*``, ``0.0.0.0`` or ``::``: that is a bind
  address, not where a worker can be reached) or ``ipc://PATH`` (same machine).
  ``inproc://`` is refused: it only reaches sockets of the router's own process.
* HTTP URLs are ``http(s)://HOST[:PORT]``; a path, query or fragment is stripped (the
  router appends its own paths), credentials in the URL are refused (they would be
  stored in Redis and listed).

No check resolves a host name: an allow-list admits a name only when it lists that name
(resolving at registration could answer differently from what the router later dials).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

import msgspec
import zmq.utils.z85

from events.auth import is_loopback, is_wildcard
from events.curve import Z85_KEY_LEN
from events.identity import WorkerId
from router.errors import RouterError

if TYPE_CHECKING:
    from router.workers.registry import WorkerRecord

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_MODELS",
    "RegistrationConflict",
    "RegistrationError",
    "RegistrationPolicy",
    "check_endpoint",
    "check_fields",
    "describe",
    "differences",
    "normalize_url",
    "parse_allowed_net",
    "url_host_port",
]

MAX_BLOCK_SIZE: Final = 4096
"""Largest block size accepted, in tokens. vLLM's blocks are 16 tokens by default and at
most a few hundred (hybrid attention/Mamba models align them upward); the router hashes
every prompt into blocks of this size, so a huge value would make every prompt shorter
than one block and silently disable prefix routing."""
MAX_TOPIC_CHARS: Final = 256
MAX_MODELS: Final = 256
"""Most model names one registration may give."""
MAX_MODEL_CHARS: Final = 256
MAX_IPC_PATH_CHARS: Final = 107  # sun_path of a Unix socket, without its NUL
_WORKER_ID: Final = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
_TCP: Final = re.compile(r"tcp://(\[[^\]]*\]|[^:\[\]]*):([0-9]+)")
_LABEL: Final = r"[A-Za-z0-9_][A-Za-z0-9_-]{0,62}"
_HOSTNAME: Final = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class RegistrationError(RouterError, ValueError):
    """A worker registration is invalid, or this router's policy refuses it."""


class RegistrationConflict(RegistrationError):
    """Another registration is saved under the worker id, and no replacement was asked for.

    Attributes:
        worker_id: The worker.
        differences: Field name -> ``(saved, requested)`` of each field that differs
            (empty when the saved registration is unusable, see ``unusable``).
        unusable: Why the saved registration cannot be read, if it cannot.
    """

    def __init__(
        self, requested: WorkerRecord, saved: WorkerRecord | None, unusable: str | None = None
    ) -> None:
        self.worker_id = requested.worker_id
        self.unusable = unusable
        self.differences = {} if saved is None else differences(saved, requested)
        if unusable is not None:
            what = f"an unusable registration is saved ({unusable})"
        else:
            what = f"it is registered with other settings: {describe(self.differences)}"
        super().__init__(f"worker {self.worker_id!r}: {what}")


def differences(saved: WorkerRecord, requested: WorkerRecord) -> dict[str, tuple[object, object]]:
    """Field name -> ``(saved, requested)`` of each field where two records differ."""
    old, new = _fields(saved), _fields(requested)
    return {name: (old[name], new[name]) for name in old if old[name] != new[name]}


def _fields(record: WorkerRecord) -> dict[str, object]:
    """A record's fields by their JSON names, models unnamed as ``()``."""
    fields = msgspec.structs.asdict(record)
    fields.pop("served_models")
    fields["models"] = record.models
    return fields


def describe(diffs: dict[str, tuple[object, object]]) -> str:
    """``"events_endpoint 'a' (saved) vs 'b' (requested), ..."`` for log lines and errors."""
    return ", ".join(f"{k} {a!r} (saved) vs {b!r} (requested)" for k, (a, b) in diffs.items())


def _check_port(what: str, text: str) -> int:
    port = int(text) if text.isdigit() else -1
    if not 1 <= port <= 65535:
        raise RegistrationError(f"{what}: port {text!r} is not in 1-65535")
    return port


def _check_host(what: str, host: str) -> str:
    """A host the router can dial: an IP literal (not a wildcard) or a host name."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv6Address(host)
        except ValueError:
            raise RegistrationError(f"{what}: {host!r} is not an IPv6 address") from None
    elif host == "*":
        ip = ipaddress.IPv4Address("0.0.0.0")
    else:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            if not host:
                raise RegistrationError(f"{what}: the host is empty") from None
            if not _HOSTNAME.fullmatch(host):
                raise RegistrationError(
                    f"{what}: {host!r} is not a host name or IP address"
                ) from None
            return host
    if ip.is_unspecified:
        raise RegistrationError(
            f"{what}: {host!r} is a wildcard (a bind address); the router connects to "
            "it, so advertise the worker's reachable address, e.g. its IP or host name "
            "(kvroute worker --advertise-host)"
        )
    return host


def check_endpoint(what: str, address: str) -> str:
    """Validate a ZeroMQ endpoint the router connects to; returns it unchanged.

    Args:
        what: Names the field in error messages (e.g. ``"events endpoint"``).
        address: ``tcp://HOST:PORT`` or ``ipc://PATH``.

    Raises:
        RegistrationError: Any other form, a bad port, a wildcard or empty host.
    """
    where = f"{what} {address!r}"
    if address.startswith("tcp://"):
        match = _TCP.fullmatch(address)
        if match is None:
            raise RegistrationError(f"{where}: expected tcp://HOST:PORT")
        _check_host(where, match.group(1))
        _check_port(where, match.group(2))
        return address
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        if not path or len(path) > MAX_IPC_PATH_CHARS or not path.isprintable():
            raise RegistrationError(
                f"{where}: expected ipc://PATH, a path of 1-{MAX_IPC_PATH_CHARS} printable "
                "characters"
            )
        return address
    if address.startswith("inproc://"):
        raise RegistrationError(
            f"{where}: inproc:// reaches only sockets inside the router's own process; "
            "use tcp://HOST:PORT or ipc://PATH"
        )
    raise RegistrationError(f"{where}: expected tcp://HOST:PORT or ipc://PATH")


def normalize_url(url: str) -> str:
    """A worker's base URL as the router stores it: ``scheme://host[:port]``.

    Path, query and fragment are dropped (the router appends ``/v1/...`` itself).

    Raises:
        RegistrationError: Not http(s), no host, a bad port, credentials, or a wildcard.
    """
    where = f"url {url!r}"
    if not url.lower().startswith(("http://", "https://")):
        raise RegistrationError(f"{where} must start with http:// or https://")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RegistrationError(f"{where}: {exc}; expected http(s)://HOST:PORT") from None
    if parts.username is not None or parts.password is not None:
        raise RegistrationError(f"{where}: credentials in the URL are not accepted")
    netloc = parts.netloc
    host = netloc.rsplit(":", 1)[0] if port is not None or netloc.endswith(":") else netloc
    _check_host(where, host)
    if port == 0 or (netloc.endswith(":") and port is None):
        raise RegistrationError(f"{where}: the port is missing or 0; expected HOST:PORT")
    return f"{parts.scheme}://{netloc}"


def url_host_port(url: str) -> tuple[str, int]:
    """``(host, port)`` of a normalized URL, the scheme's default port when none is given."""
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or _DEFAULT_PORTS[parts.scheme]


def check_fields(
    *,
    worker_id: WorkerId,
    events_endpoint: str,
    replay_endpoint: str | None,
    http_url: str | None,
    block_size: int,
    topic: str,
    server_key: str | None,
    models: tuple[str, ...] = (),
) -> str | None:
    """Validate a record's fields; returns its normalized ``http_url``.

    Raises:
        RegistrationError: The first invalid field, named, with what was expected.
    """
    _check_models(models)
    if not _WORKER_ID.fullmatch(worker_id):
        raise RegistrationError(
            f"worker id {worker_id!r} is not valid: use 1-128 characters from [A-Za-z0-9_.:@-]"
        )
    check_endpoint("events endpoint", events_endpoint)
    if replay_endpoint is not None:
        check_endpoint("replay endpoint", replay_endpoint)
    if isinstance(block_size, bool) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise RegistrationError(
            f"block_size must be 1-{MAX_BLOCK_SIZE} tokens (vLLM's default is 16), got {block_size}"
        )
    if len(topic) > MAX_TOPIC_CHARS or not topic.isprintable():
        raise RegistrationError(
            f"topic must be at most {MAX_TOPIC_CHARS} printable characters, got {topic[:40]!r}"
        )
    if server_key is not None:
        _check_server_key(server_key)
    return None if http_url is None else normalize_url(http_url)


def _check_models(models: tuple[str, ...]) -> None:
    """Model names: 1-256 printable characters each, no duplicate, at most 256 of them."""
    if len(models) > MAX_MODELS:
        raise RegistrationError(f"models: at most {MAX_MODELS} names, got {len(models)}")
    for name in models:
        if not (isinstance(name, str) and 0 < len(name) <= MAX_MODEL_CHARS and name.isprintable()):
            raise RegistrationError(
                f"models: {str(name)[:40]!r} is not a model name (1-{MAX_MODEL_CHARS} "
                "printable characters)"
            )
    if len(set(models)) != len(models):
        raise RegistrationError(f"models: a name is given twice in {list(models)}")


def _check_server_key(key: str) -> None:
    try:
        valid = len(key) == Z85_KEY_LEN and len(zmq.utils.z85.decode(key)) == 32
    except (ValueError, KeyError, struct.error):  # non-ASCII, outside z85, overflow
        valid = False
    if not valid:
        raise RegistrationError(
            f"server_key must be a z85 CURVE public key of {Z85_KEY_LEN} characters "
            "(the text of the worker's NAME.key file)"
        )


def parse_allowed_net(text: str) -> Network | str:
    """One ``--allow-worker-net`` value: a CIDR or IP address, else an exact host name.

    Raises:
        RegistrationError: Neither.
    """
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(text):
        raise RegistrationError(
            f"--allow-worker-net {text!r}: expected a CIDR (10.0.0.0/8), an IP address "
            "or a host name"
        )
    return text.rstrip(".").lower()


@dataclass(frozen=True)
class RegistrationPolicy:
    """What one router admits beyond a record's own validity.

    Attributes:
        allowed_nets: Where workers may be (``--allow-worker-net``): networks and exact
            host names; every host of a record (URL and tcp endpoints) must match one.
            Empty: any host. ``ipc://`` endpoints are on this machine and always pass.
        require_curve: Refuse a worker without a ``server_key`` (``--require-curve``), so
            only a publisher holding the registered key's secret can feed the index.
        own_address: The router's own HTTP ``(host, port)``: a worker URL pointing back
            at it would make the router proxy requests to itself.
    """

    allowed_nets: tuple[Network | str, ...] = ()
    require_curve: bool = False
    own_address: tuple[str, int] | None = None
    _names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = frozenset(n for n in self.allowed_nets if isinstance(n, str))
        object.__setattr__(self, "_names", names)

    @classmethod
    def from_flags(
        cls,
        allowed: Iterable[str] = (),
        *,
        require_curve: bool = False,
        own_address: tuple[str, int] | None = None,
    ) -> RegistrationPolicy:
        """A policy from ``--allow-worker-net`` values (see :func:`parse_allowed_net`)."""
        nets = tuple(parse_allowed_net(a) for a in allowed)
        return cls(nets, require_curve, own_address)

    def check(self, record: WorkerRecord) -> None:
        """Refuse ``record`` if this router's rules do not admit it.

        Raises:
            RegistrationError: Names the rule and the flag that sets it.
        """
        if self.require_curve and record.server_key is None:
            raise RegistrationError(
                f"worker {record.worker_id!r} has no server_key, and this router requires "
                "CURVE-authenticated event streams (--require-curve): register it with the "
                "worker's public key (the text of its NAME.key file)"
            )
        if record.http_url is not None:
            self._check_not_self(record.http_url)
        if self.allowed_nets:
            for what, host in _hosts(record):
                self._check_allowed(what, host)

    def _check_not_self(self, url: str) -> None:
        if self.own_address is None:
            return
        own_host, own_port = self.own_address
        host, port = url_host_port(url)
        if port != own_port:
            return
        local = is_loopback(own_host) or is_wildcard(own_host)
        if host.lower() == own_host.lower().strip("[]") or (is_loopback(host) and local):
            raise RegistrationError(
                f"url {url!r} is this router's own address: a worker's URL must point at "
                "the worker's HTTP server"
            )
        if is_wildcard(own_host) and host.lower() == socket.gethostname().lower():
            raise RegistrationError(f"url {url!r} is this router's own address (its host name)")

    def _check_allowed(self, what: str, host: str) -> None:
        bare = host.strip("[]")
        try:
            ip = ipaddress.ip_address(bare)
        except ValueError:
            if bare.rstrip(".").lower() in self._names:
                return
        else:
            if any(not isinstance(n, str) and ip in n for n in self.allowed_nets):
                return
        allowed = ", ".join(str(n) for n in self.allowed_nets)
        raise RegistrationError(
            f"{what} host {bare!r} is outside the networks this router may reach "
            f"(--allow-worker-net {allowed}); host names are matched by name, not resolved"
        )


def _hosts(record: WorkerRecord) -> list[tuple[str, str]]:
    """``(field, host)`` of every network host a record makes the router dial."""
    out = []
    if record.http_url is not None:
        out.append(("url", url_host_port(record.http_url)[0]))
    for what, endpoint in (("events", record.events_endpoint), ("replay", record.replay_endpoint)):
        match = _TCP.fullmatch(endpoint or "")
        if match is not None:
            out.append((what, match.group(1)))
    return out
