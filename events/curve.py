"""ZeroMQ CURVE keys and socket security for authenticated KV event streams.

The worker side (PUB and replay ROUTER) is the CURVE *server*: it holds a server key pair
and, optionally, an allow-list of client public keys enforced by a ZAP authenticator. The
subscriber side is the CURVE *client*: it must know the server's public key (so a forged
publisher cannot complete the handshake) and presents its own key pair. Keys are z85 text
(40 characters) in the file format of :func:`zmq.auth.create_certificates`
(``NAME.key`` public, ``NAME.key_secret`` secret).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from events.errors import EventsError

__all__ = [
    "ZAP_DOMAIN",
    "CurveClientConfig",
    "CurveKeyError",
    "CurveKeyPair",
    "CurveServerConfig",
    "EventAuthenticator",
    "configure_client",
    "configure_server",
    "load_public_key",
    "write_keypair",
]

_log = logging.getLogger(__name__)

Z85_KEY_LEN: Final = 40
ZAP_DOMAIN: Final = "kvroute"
"""ZAP domain of kvroute's event sockets (the allow-list applies to it)."""


class CurveKeyError(EventsError, ValueError):
    """A CURVE key or key file is missing or malformed."""


def _check_key(key: bytes, what: str) -> bytes:
    if len(key) != Z85_KEY_LEN:
        raise CurveKeyError(
            f"{what} must be a z85 CURVE key of {Z85_KEY_LEN} characters, got {len(key)}; "
            "generate keys with `kvroute keys`"
        )
    return key


@dataclass(frozen=True, slots=True)
class CurveKeyPair:
    """A CURVE key pair, both halves z85-encoded (40 bytes each)."""

    public_key: bytes
    secret_key: bytes

    def __post_init__(self) -> None:
        _check_key(self.public_key, "public key")
        _check_key(self.secret_key, "secret key")

    def __repr__(self) -> str:
        return f"CurveKeyPair(public_key={self.public_key!r}, secret_key=<hidden>)"

    @classmethod
    def generate(cls) -> CurveKeyPair:
        """A fresh random key pair."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, secret_file: str | os.PathLike[str]) -> CurveKeyPair:
        """Load a key pair from a ``NAME.key_secret`` file.

        Raises:
            CurveKeyError: The file is missing or holds no secret key.
        """
        public, secret = _load_certificate(secret_file)
        if secret is None:
            raise CurveKeyError(f"{secret_file} holds no secret key; pass the NAME.key_secret file")
        return cls(public, secret)


def _load_certificate(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read CURVE key file {os.fspath(path)!r}: {exc}") from exc
    return public, secret


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The z85 public key in a ``NAME.key`` (or ``NAME.key_secret``) file.

    Raises:
        CurveKeyError: The file is missing or malformed.
    """
    public, _ = _load_certificate(path)
    return _check_key(public, f"public key in {os.fspath(path)}")


def write_keypair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Generate a key pair and write ``NAME.key`` and ``NAME.key_secret`` (mode 0600).

    Returns:
        The public and secret file paths.

    Raises:
        CurveKeyError: A file of that name already exists (keys are never overwritten).
    """
    out = Path(directory)
    public_path, secret_path = out / f"{name}.key", out / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists():
            raise CurveKeyError(f"{path} exists; remove it or choose another --name")
    out.mkdir(parents=True, exist_ok=True)
    written_public, written_secret = zmq.auth.create_certificates(out, name)
    os.chmod(written_secret, 0o600)
    return Path(written_public), Path(written_secret)


@dataclass(frozen=True, slots=True)
class CurveServerConfig:
    """CURVE settings of a publisher (the worker side).

    Attributes:
        keypair: The worker's server key pair; subscribers are given its public key.
        allowed_client_keys: z85 public keys of the subscribers allowed to connect;
            ``None`` accepts any client that completes the CURVE handshake (the stream is
            still encrypted and the server authenticated).
    """

    keypair: CurveKeyPair
    allowed_client_keys: frozenset[bytes] | None = None

    def __post_init__(self) -> None:
        for key in self.allowed_client_keys or ():
            _check_key(key, "allowed client key")


@dataclass(frozen=True, slots=True)
class CurveClientConfig:
    """CURVE settings of a subscriber for one worker.

    Attributes:
        server_public_key: The worker's z85 server public key.
        keypair: The subscriber's own key pair (its public key is on the worker's allow-list).
    """

    server_public_key: bytes
    keypair: CurveKeyPair

    def __post_init__(self) -> None:
        _check_key(self.server_public_key, "server public key")


def configure_server(socket: zmq.Socket[Any], config: CurveServerConfig) -> None:
    """Make ``socket`` a CURVE server; call before it binds or connects."""
    socket.curve_secretkey = config.keypair.secret_key
    socket.curve_publickey = config.keypair.public_key
    socket.curve_server = True
    socket.zap_domain = ZAP_DOMAIN.encode()


def configure_client(socket: zmq.Socket[Any], config: CurveClientConfig) -> None:
    """Make ``socket`` a CURVE client of ``config``'s server; call before it connects."""
    socket.curve_serverkey = config.server_public_key
    socket.curve_publickey = config.keypair.public_key
    socket.curve_secretkey = config.keypair.secret_key


class _AllowList:
    """ZAP credentials provider: admits the z85 client keys of a fixed set."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self._allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._allowed:
            return True
        _log.warning("rejected CURVE client %s (not on the allow-list)", key.decode())
        return False


class EventAuthenticator:
    """Enforces a :class:`CurveServerConfig` allow-list for the sockets of one context.

    A thin owner of pyzmq's ZAP :class:`ThreadAuthenticator`: started before the sockets
    bind, stopped after they close. Does nothing when the allow-list is ``None``.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], config: CurveServerConfig):
        self._auth: ThreadAuthenticator | None = None
        if config.allowed_client_keys is not None:
            self._auth = ThreadAuthenticator(context, log=_log)
            self._auth.start()
            self._auth.configure_curve_callback(
                ZAP_DOMAIN, credentials_provider=_AllowList(config.allowed_client_keys)
            )

    def stop(self) -> None:
        """Stop the ZAP handler (idempotent)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
