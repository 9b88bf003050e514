"""Bearer keys of kvroute's HTTP endpoints: loading a key, checking a request's, loopback hosts.

Workers and routers guard their mutating and revealing endpoints with keys given as a
flag value, a file (safer: a flag shows in ``ps``) or an environment variable; a request
presents one as ``Authorization: Bearer KEY``, compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

from events.errors import EventsError

__all__ = ["AuthKeyError", "bearer_ok", "is_loopback_host", "load_key"]


class AuthKeyError(EventsError, ValueError):
    """A key is given twice, empty, unreadable or holds whitespace."""


def load_key(value: str | None, file: str | None, env: str) -> str | None:
    """A key from a flag value, else a file, else the environment variable ``env``.

    Args:
        value: The key itself (``--admin-key KEY``).
        file: A file holding the key (``--admin-key-file FILE``); surrounding
            whitespace and a final newline are dropped.
        env: Name of the environment variable read when neither is given.

    Returns:
        The key, or None when none is configured.

    Raises:
        AuthKeyError: Both ``value`` and ``file`` are given, the file cannot be read,
            or the key is empty or holds whitespace.
    """
    if value is not None and file is not None:
        raise AuthKeyError(f"give the key or a key file, not both (see ${env})")
    if file is not None:
        try:
            key = Path(file).read_text().strip()
        except (OSError, UnicodeError) as exc:
            raise AuthKeyError(f"cannot read key file {file!r}: {exc}") from None
        where = f"key file {file!r}"
    elif value is not None:
        key, where = value, "the key given"
    elif os.environ.get(env):
        key, where = os.environ[env], f"${env}"
    else:
        return None
    if not key or any(c.isspace() for c in key):
        raise AuthKeyError(f"{where} is empty or holds whitespace: a key is one word")
    return key


def bearer_ok(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header presents ``key`` as a bearer token.

    The token is compared in constant time (``hmac.compare_digest``), so the answer's
    timing does not reveal how much of a guess was right.
    """
    if header is None:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name, an IP literal, IPv6 with or without brackets) is loopback."""
    bare = host.strip().strip("[]").rstrip(".").lower()
    if bare in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False
