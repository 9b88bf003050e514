"""ZeroMQ endpoint configuration: explicit bind or connect, and data-parallel port offsets.

An :class:`Endpoint` never guesses from the address whether to bind or connect (vLLM
guesses from a ``*`` in the host); the caller says which. Defaults everywhere in kvroute
bind to ``127.0.0.1`` only.

Data parallelism: each rank of a data-parallel engine publishes on ``port + rank``, for its
PUB socket and its replay socket alike (:func:`data_parallel_endpoint`). vLLM's documented
pair ``5557`` (PUB) / ``5558`` (replay) therefore collides from rank 1 on: rank 1's PUB
port is rank 0's replay port. The replay base port must sit at least ``dp_size`` above the
PUB base port; :func:`check_data_parallel_ports` rejects overlapping ranges.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import zmq

from events.errors import EventsError

__all__ = [
    "Endpoint",
    "EndpointError",
    "check_data_parallel_ports",
    "data_parallel_endpoint",
    "tcp_port",
]

_TRANSPORTS: Final = ("tcp://", "ipc://", "inproc://")
_TCP_PORT: Final = re.compile(r"^(tcp://.*):(\d+)$")


class EndpointError(EventsError, ValueError):
    """An endpoint address is malformed, or a bind or connect failed."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A ZeroMQ address and whether this side binds it or connects to it.

    Attributes:
        address: ``tcp://HOST:PORT`` (port ``*`` lets the OS choose when binding),
            ``ipc://PATH`` or ``inproc://NAME``.
        bind: ``True`` to bind, ``False`` to connect.
    """

    address: str
    bind: bool

    def __post_init__(self) -> None:
        if not self.address.startswith(_TRANSPORTS):
            raise EndpointError(
                f"endpoint {self.address!r} must start with one of {', '.join(_TRANSPORTS)}"
            )

    @classmethod
    def binding(cls, address: str) -> Endpoint:
        """An endpoint this side binds."""
        return cls(address, bind=True)

    @classmethod
    def connecting(cls, address: str) -> Endpoint:
        """An endpoint this side connects to."""
        return cls(address, bind=False)

    def attach(self, socket: zmq.Socket[bytes]) -> str:
        """Bind or connect ``socket`` to this endpoint.

        Returns:
            The address in effect: for a bind, the resolved one (the OS-chosen port of
            ``tcp://127.0.0.1:*``); for a connect, :attr:`address`.

        Raises:
            EndpointError: The bind or connect failed (address in use, bad host, ...).
        """
        try:
            if not self.bind:
                socket.connect(self.address)
                return self.address
            socket.bind(self.address)
        except zmq.ZMQError as exc:
            verb = "bind" if self.bind else "connect"
            raise EndpointError(
                f"cannot {verb} {self.address!r}: {exc.strerror}; choose another address "
                "or stop the process that holds it"
            ) from exc
        resolved = socket.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(resolved, bytes)
        return resolved.decode()

    def for_rank(self, rank: int) -> Endpoint:
        """This endpoint shifted for a data-parallel rank (see :func:`data_parallel_endpoint`)."""
        return Endpoint(data_parallel_endpoint(self.address, rank), self.bind)


def tcp_port(address: str) -> int | None:
    """The port of a ``tcp://HOST:PORT`` address, ``None`` for other transports or ``*``."""
    match = _TCP_PORT.match(address)
    return int(match.group(2)) if match else None


def data_parallel_endpoint(address: str, rank: int) -> str:
    """The address data-parallel rank ``rank`` uses: ``port + rank`` for tcp.

    ``ipc://`` and ``inproc://`` addresses get a ``-dp{rank}`` suffix from rank 1 on.

    Raises:
        EndpointError: ``rank`` is negative, or a tcp address has no numeric port.
    """
    if rank < 0:
        raise EndpointError(f"data-parallel rank must be >= 0, got {rank}")
    if not address.startswith("tcp://"):
        return address if rank == 0 else f"{address}-dp{rank}"
    match = _TCP_PORT.match(address)
    if match is None:
        raise EndpointError(f"data-parallel offsets need a numeric tcp port, got {address!r}")
    port = int(match.group(2)) + rank
    if port > 65535:
        raise EndpointError(f"{address!r} + rank {rank} is past port 65535")
    return f"{match.group(1)}:{port}"


def check_data_parallel_ports(pub_address: str, replay_address: str, dp_size: int) -> None:
    """Reject PUB and replay base ports whose per-rank ranges overlap.

    Ranks ``0 .. dp_size-1`` use ``base + rank`` on both sockets, so the ranges
    ``[pub, pub + dp_size)`` and ``[replay, replay + dp_size)`` must be disjoint when both
    addresses are tcp (one engine binds both on the same host).

    Raises:
        EndpointError: The ranges overlap; the message names the smallest safe replay port.
    """
    if dp_size < 1:
        raise EndpointError(f"dp_size must be >= 1, got {dp_size}")
    pub_match, replay_match = _TCP_PORT.match(pub_address), _TCP_PORT.match(replay_address)
    if pub_match is None or replay_match is None:
        return
    pub, replay = int(pub_match.group(2)), int(replay_match.group(2))
    if pub < replay + dp_size and replay < pub + dp_size:
        raise EndpointError(
            f"with dp_size={dp_size}, PUB ports {pub}..{pub + dp_size - 1} and replay ports "
            f"{replay}..{replay + dp_size - 1} overlap; use replay port >= {pub + dp_size}"
        )
