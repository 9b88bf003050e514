"""``--event-loop``: the loop a serving process runs on (uvloop where installed)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest

from router.cli.event_loop import run_on
from router.errors import RouterError

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_runs_on_asyncio_s_own_loop() -> None:
    assert run_on("asyncio", _loop_module()).startswith("asyncio")


def test_auto_takes_uvloop_when_installed_else_asyncio() -> None:
    expected = "uvloop" if HAS_UVLOOP else "asyncio"
    assert run_on("auto", _loop_module()).startswith(expected)


def test_without_uvloop_auto_is_asyncio_and_uvloop_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    assert run_on("auto", _loop_module()).startswith("asyncio")
    main = _loop_module()
    with pytest.raises(RouterError, match=r"pip install 'kvroute\[fast\]'"):
        run_on("uvloop", main)
    assert main.cr_frame is None  # closed: no "never awaited" warning


@pytest.mark.skipif(not HAS_UVLOOP, reason="uvloop is not installed")
def test_uvloop_asked_for_runs_on_it() -> None:
    assert run_on("uvloop", _loop_module()).startswith("uvloop")
