"""Subprocesses that live and die together: start, watch, health-check and stop them.

:class:`ProcessGroup` starts each process in its own session (so a Ctrl-C reaches only
the parent, which then stops them in order) with its output in ``NAME.log``, and stops
them all on exit; on Linux each child is also asked to die with its parent, so even a
SIGKILL of the parent leaves no orphans. :func:`wait_healthy` polls a started HTTP
server's ``/health``; :func:`terminate_as_interrupt` makes SIGTERM clean up like Ctrl-C;
:func:`log_directory` gives the logs a home that outlives the run only when it failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final

import aiohttp

from router.errors import RouterError

__all__ = [
    "LogDirectory",
    "ProcessError",
    "ProcessGroup",
    "log_directory",
    "terminate_as_interrupt",
    "wait_healthy",
]

_LOG: Final = logging.getLogger(__name__)
_PR_SET_PDEATHSIG: Final = 1


class ProcessError(RouterError, RuntimeError):
    """A process of a group is already running, died, or never became healthy."""


def _death_signal_setter() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies (Linux).

    NOTE: ``prctl`` is looked up here, in the parent: the child, forked from a process that
    may run other threads, only makes the one call (no ``dlopen`` that could deadlock).
    """
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    signum = int(signal.SIGKILL)

    def set_death_signal() -> None:  # pragma: no cover - runs in the child before exec
        prctl(_PR_SET_PDEATHSIG, signum)

    return set_death_signal


class ProcessGroup:
    """Subprocesses that live and die together, each logging to its own file.

    Args:
        log_dir: Directory of the ``NAME.log`` files (created if missing).
        stop_timeout_s: How long a process gets to exit after SIGTERM before SIGKILL.
    """

    def __init__(self, log_dir: Path, stop_timeout_s: float = 10.0) -> None:
        self.log_dir = log_dir
        self._stop_timeout_s = stop_timeout_s
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._preexec = _death_signal_setter()

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start ``argv`` as process ``name`` (its own session, so Ctrl-C reaches us only).

        Args:
            name: The process's name in this group and in its log file's name.
            argv: The command line.

        Raises:
            ProcessError: A process of that name is already running.
        """
        if name in self._procs:
            raise ProcessError(f"process {name!r} is already running")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self._preexec,
            )
        self._procs[name] = proc
        _LOG.debug("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
        return proc

    def check_alive(self) -> None:
        """Raise if any process has exited.

        Raises:
            ProcessError: Names the process, its exit code and the end of its log.
        """
        for name, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                raise ProcessError(
                    f"{name} exited with code {code}; last lines of its log:\n{self.log_tail(name)}"
                )

    def log_tail(self, name: str, num_chars: int = 2000) -> str:
        """The end of a process's log."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def stop(self, names: Sequence[str] | None = None) -> None:
        """Stop some processes (all when ``None``): SIGTERM, wait, then SIGKILL."""
        chosen = list(self._procs) if names is None else [n for n in names if n in self._procs]
        for name in chosen:
            with contextlib.suppress(ProcessLookupError):
                self._procs[name].terminate()
        deadline = time.monotonic() + self._stop_timeout_s
        for name in chosen:
            proc = self._procs.pop(name)
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _LOG.warning("%s did not exit on SIGTERM; killing it", name)
                proc.kill()
                proc.wait()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class LogDirectory:
    """Where a run's processes log, and whether the directory outlives the run.

    Attributes:
        path: The directory.
        is_temporary: Created for this run (not given by the user).
        is_kept: A temporary directory stays after the run (set by :meth:`keep`).
    """

    def __init__(self, path: Path, is_temporary: bool) -> None:
        self.path = path
        self.is_temporary = is_temporary
        self.is_kept = False

    def keep(self) -> None:
        """Leave the directory in place after the run (it holds the logs of a failure)."""
        self.is_kept = True


@contextlib.contextmanager
def log_directory(given: Path | None, prefix: str = "kvroute-cluster-") -> Iterator[LogDirectory]:
    """The directory for a run's process logs.

    Args:
        given: The user's directory, always kept; ``None`` creates a temporary one.
        prefix: Name prefix of a temporary directory.

    Yields:
        The directory. A temporary one is removed at the end of the block unless the block
        raised an error other than ``KeyboardInterrupt`` (the logs explain it) or called
        :meth:`LogDirectory.keep`.
    """
    if given is not None:
        yield LogDirectory(given, is_temporary=False)
        return
    directory = LogDirectory(Path(tempfile.mkdtemp(prefix=prefix)), is_temporary=True)
    try:
        yield directory
    except KeyboardInterrupt:
        raise
    except BaseException:
        directory.keep()
        raise
    finally:
        if not directory.is_kept:
            shutil.rmtree(directory.path, ignore_errors=True)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into ``KeyboardInterrupt`` so cleanup runs as it does on Ctrl-C."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


async def wait_healthy(
    session: aiohttp.ClientSession, url: str, group: ProcessGroup, deadline: float
) -> None:
    """Poll ``GET url/health`` until it answers 200.

    Raises:
        ProcessError: A process of ``group`` died, or ``deadline`` (monotonic) passed.
    """
    while True:
        group.check_alive()
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(2)) as resp:
                if resp.status == 200:
                    return
        if time.monotonic() > deadline:
            raise ProcessError(f"{url}/health did not answer 200 in time")
        await asyncio.sleep(0.1)  # polling a process we started; nothing to wait on
