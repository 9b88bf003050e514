"""Bearer-token authentication shared by the router and the worker: where keys come from,
how a request's ``Authorization`` header is checked (and what a process sends as one), and
whether a bind stays on this host or is a wildcard.

A key is given by a flag (``--admin-key KEY``), a file flag (``--admin-key-file PATH``, the
first line of the file) or, when neither flag is given, an environment variable
(``KVROUTE_ADMIN_KEY``, else ``KVROUTE_ADMIN_KEY_FILE`` naming a file). The HTTP layers
keep the transport: they ask :meth:`BearerKey.accepts` and, on ``False``, answer 401 with
``WWW-Authenticate: <challenge(header)>``. Nothing here performs network I/O.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from events.errors import EventsError

__all__ = [
    "ADMIN_KEY",
    "API_KEY",
    "AuthKeyError",
    "BearerKey",
    "KeySpec",
    "SentKey",
    "add_key_arguments",
    "challenge",
    "is_loopback",
    "is_wildcard",
    "load_key",
    "load_sent_key",
]

_TOKEN: Final = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
"""RFC 6750's ``b64token``: what a bearer token may contain (it travels in a header)."""
_REALM: Final = "kvroute"


class AuthKeyError(EventsError, ValueError):
    """A key is malformed, given twice, or its file cannot be read."""


class BearerKey:
    """A secret bearer token and where it came from; its repr never shows the secret.

    Args:
        secret: The token: RFC 6750 ``b64token`` characters (letters, digits, ``-._~+/``,
            trailing ``=``), so that it fits in an ``Authorization`` header unchanged.
        source: Where it came from, for log lines (``"--admin-key-file /etc/k"``).

    Raises:
        AuthKeyError: ``secret`` is empty or has other characters (whitespace included).
    """

    __slots__ = ("_digest", "source")

    def __init__(self, secret: str, source: str) -> None:
        _check_token(secret, source)
        # NOTE: only the digest is kept; comparing digests of equal length hides the
        # secret's length from timing as well as its content.
        self._digest = _digest(secret.encode())
        self.source = source

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries this key, in constant time.

        The scheme ``Bearer`` is matched case-insensitively (RFC 7235); anything else,
        a missing header included, is refused.
        """
        token = _bearer_token(authorization)
        if token is None:
            return False
        return hmac.compare_digest(self._digest, _digest(token.encode()))

    def __repr__(self) -> str:
        return f"BearerKey(source={self.source!r})"


class SentKey:
    """A bearer token this process sends (to a router it registers with), and its source.

    Its repr never shows the secret; :attr:`authorization` is the header value to send.

    Raises:
        AuthKeyError: As :class:`BearerKey`.
    """

    __slots__ = ("_secret", "source")

    def __init__(self, secret: str, source: str) -> None:
        _check_token(secret, source)
        self._secret = secret
        self.source = source

    @property
    def authorization(self) -> str:
        """The ``Authorization`` header value carrying the key."""
        return f"Bearer {self._secret}"

    def __repr__(self) -> str:
        return f"SentKey(source={self.source!r})"


@dataclass(frozen=True, slots=True)
class KeySpec:
    """The names one key goes by on the command line and in the environment.

    Attributes:
        flag: The flag that gives the key itself (``--admin-key``); ``FLAG-file`` gives a
            file holding it.
        env: The environment variable holding the key (``KVROUTE_ADMIN_KEY``);
            ``ENV_FILE`` names a file holding it.
        what: What the key protects, for help texts (``"prefix-cache reset and snapshot"``).
        is_sent: The key is one this process sends (:class:`SentKey`), not one it checks.
    """

    flag: str
    env: str
    what: str
    is_sent: bool = False

    @property
    def file_flag(self) -> str:
        """The flag naming a key file."""
        return f"{self.flag}-file"

    @property
    def file_env(self) -> str:
        """The environment variable naming a key file."""
        return f"{self.env}_FILE"

    @property
    def dest(self) -> str:
        """The argparse destination of :attr:`flag` (``admin_key``)."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def file_dest(self) -> str:
        """The argparse destination of :attr:`file_flag` (``admin_key_file``)."""
        return f"{self.dest}_file"


ADMIN_KEY: Final = KeySpec(
    "--admin-key", "KVROUTE_ADMIN_KEY", "endpoints that change or reveal the cache"
)
"""The key of the administrative endpoints (router and worker alike)."""
API_KEY: Final = KeySpec("--api-key", "KVROUTE_API_KEY", "the inference endpoints")
"""The key of the inference endpoints (router and worker alike)."""
WORKER_API_KEY: Final = KeySpec(
    "--worker-api-key",
    "KVROUTE_WORKER_API_KEY",
    "requests forwarded to workers: their --api-key (it replaces a client's forwarded "
    "Authorization)",
    is_sent=True,
)
"""The workers' inference key, which a router sends with each forwarded request."""
WORKER_ADMIN_KEY: Final = KeySpec(
    "--worker-admin-key",
    "KVROUTE_WORKER_ADMIN_KEY",
    "reading kvroute workers' GET /v1/snapshot: their --admin-key",
    is_sent=True,
)
"""The workers' admin key, which a router (or ``kvroute index check``) sends to read a
worker's snapshot."""


def add_key_arguments(parser: argparse.ArgumentParser, spec: KeySpec) -> None:
    """Add ``spec.flag KEY`` and ``spec.file_flag PATH`` to ``parser``.

    Both default to ``None``: :func:`load_key` reads the environment only when neither is
    given, so the parser never holds an environment secret.
    """
    parser.add_argument(
        spec.flag,
        dest=spec.dest,
        metavar="KEY",
        default=None,
        help=f"bearer token {'sent for' if spec.is_sent else 'required on'} {spec.what} "
        f"(visible in the process list: prefer "
        f"{spec.file_flag} or ${spec.env}; default: ${spec.env}, else the file named by "
        f"${spec.file_env}, else none)",
    )
    parser.add_argument(
        spec.file_flag,
        dest=spec.file_dest,
        metavar="PATH",
        default=None,
        help=f"file whose first line is the {spec.flag} token",
    )


def load_key(
    spec: KeySpec,
    value: str | None,
    file: str | os.PathLike[str] | None,
    environ: Mapping[str, str] | None = None,
) -> BearerKey | None:
    """The key given by a flag, a file flag or, failing both, the environment.

    Args:
        spec: The key's flag and variable names.
        value: The value of ``spec.flag``, or ``None``.
        file: The value of ``spec.file_flag``, or ``None``.
        environ: The environment (``os.environ`` by default).

    Returns:
        The key, or ``None`` when none of the four sources gives one.

    Raises:
        AuthKeyError: Both sources of one kind are given (two flags, or two variables), a
            file cannot be read, or the key is malformed.
    """
    found = _find_key(spec, value, file, os.environ if environ is None else environ)
    return None if found is None else BearerKey(*found)


def load_sent_key(
    spec: KeySpec,
    value: str | None,
    file: str | os.PathLike[str] | None,
    environ: Mapping[str, str] | None = None,
) -> SentKey | None:
    """A key this process sends, found as :func:`load_key` finds one it checks.

    Raises:
        AuthKeyError: As :func:`load_key`.
    """
    found = _find_key(spec, value, file, os.environ if environ is None else environ)
    return None if found is None else SentKey(*found)


def _find_key(
    spec: KeySpec,
    value: str | None,
    file: str | os.PathLike[str] | None,
    env: Mapping[str, str],
) -> tuple[str, str] | None:
    """``(secret, source)`` of the key given by a flag, a file flag or the environment."""
    if value is not None and file is not None:
        raise AuthKeyError(f"give {spec.flag} or {spec.file_flag}, not both")
    if value is not None:
        return value, spec.flag
    if file is not None:
        return _read_key_file(file, spec.file_flag)
    env_value, env_file = env.get(spec.env), env.get(spec.file_env)
    if env_value is not None and env_file is not None:
        raise AuthKeyError(f"set ${spec.env} or ${spec.file_env}, not both")
    if env_value is not None:
        return env_value, f"${spec.env}"
    if env_file is not None:
        return _read_key_file(env_file, f"${spec.file_env}")
    return None


def challenge(authorization: str | None) -> str:
    """The ``WWW-Authenticate`` value of a 401 answering this ``Authorization`` header.

    Per RFC 6750: no credentials get the bare challenge; a bearer token that was refused
    gets ``error="invalid_token"``, and other credentials ``error="invalid_request"``.
    """
    if not authorization:
        return f'Bearer realm="{_REALM}"'
    error = "invalid_token" if _bearer_token(authorization) is not None else "invalid_request"
    return f'Bearer realm="{_REALM}", error="{error}"'


def is_loopback(host: str) -> bool:
    """Whether a listen address keeps a server on this host.

    ``localhost`` and loopback IPs (``127.0.0.0/8``, ``::1``, ``::ffff:127.0.0.1``,
    bracketed or not) are;
    wildcards (``""``, ``0.0.0.0``, ``::``) and any other name or address are not, since a
    name may resolve anywhere.
    """
    name = host.strip().removeprefix("[").removesuffix("]")
    if name.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is IPv4 loopback
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def is_wildcard(host: str) -> bool:
    """Whether a listen address is a wildcard (every interface): ``""``, ``*``,
    ``0.0.0.0`` or ``::`` (bracketed or not).

    A wildcard is where a server binds, never where another host can reach it.
    """
    name = host.strip().removeprefix("[").removesuffix("]")
    if name in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(name).is_unspecified
    except ValueError:
        return False


def _read_key_file(path: str | os.PathLike[str], source: str) -> tuple[str, str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthKeyError(f"cannot read the key file {str(path)!r} ({source}): {exc}") from exc
    lines = text.splitlines()
    return (lines[0].strip() if lines else ""), f"{source} {path}"


def _check_token(secret: str, source: str) -> None:
    if not _TOKEN.fullmatch(secret):
        raise AuthKeyError(
            f"the key from {source} is empty or has characters a bearer token cannot "
            "carry; use letters, digits and -._~+/ (e.g. `openssl rand -hex 32`)"
        )


def _bearer_token(authorization: str | None) -> str | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
