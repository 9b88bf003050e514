"""Progress on a terminal: log lines print above the bar, Ctrl-C leaves no bar behind.

Each command runs with stdout and stderr on a pseudo-terminal (120 columns), as in an
interactive shell, and gets SIGINT (Ctrl-C) once its output shows it is mid-run. The
raw bytes are checked: a log line must start a line of its own (after the bar's
carriage-return erase), and nothing may be drawn after the final message.
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT as ROOT

pytestmark = pytest.mark.slow


def _run_in_terminal(
    argv: list[str], cwd: Path, interrupt_when: Callable[[str], bool], timeout_s: float
) -> tuple[int, str]:
    """Run ``argv`` on a pseudo-terminal; SIGINT it once ``interrupt_when(output)`` holds."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", *argv],
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    chunks: list[bytes] = []
    ready = threading.Event()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's last writer exited
                break
            if not chunk:
                break
            chunks.append(chunk)
            if interrupt_when(b"".join(chunks).decode(errors="replace")):
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(timeout_s), b"".join(chunks).decode(errors="replace")
        assert proc.poll() is None, b"".join(chunks).decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


def _starts_a_line(output: str, message: str) -> bool:
    at = output.index(message)
    return at == 0 or output[at - 1] in "\r\n"


def _after(output: str, message: str) -> str:
    return output.split(message, 1)[1]


def test_cluster_logs_above_its_bar_and_clears_it_on_ctrl_c(tmp_path: Path, redis_url: str) -> None:
    second_start = "kvroute cluster: round_robin: 2 workers and the router are up"
    argv = ["cluster", "--quick", "--redis", redis_url, "--no-plot",
            "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    code, out = _run_in_terminal(argv, tmp_path, lambda o: second_start in o, timeout_s=240)
    assert code == 130, out
    assert "req" in out.split(second_start)[0]  # a bar was drawn before the log line
    assert _starts_a_line(out, second_start), repr(out[out.index(second_start) - 80 :])
    message = "kvroute cluster: interrupted; every process started was stopped"
    assert _starts_a_line(out, message), repr(out[-300:])
    assert _after(out, message).strip() == "", repr(_after(out, message))  # no stale bar
    assert "Traceback" not in out


def test_sim_logs_above_its_bar_and_exits_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    done = "kvroute sim: cache_aware: "
    argv = ["sim", "--policy", "cache_aware,round_robin"]
    code, out = _run_in_terminal(argv, tmp_path, lambda o: done in o, timeout_s=240)
    assert code == 130, out
    assert _starts_a_line(out, done), repr(out[out.index(done) - 80 :])
    assert _starts_a_line(out, "kvroute sim: interrupted")
    assert _after(out, "kvroute sim: interrupted").strip() == ""
    assert "Traceback" not in out
