"""Worker authentication: bearer keys on the admin and inference endpoints, from flags, files
and the environment; open probes; a warning when an unkeyed API leaves loopback."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from events.auth import BearerKey
from pool.worker.cli import exposure_warning, main
from pool.worker.config import config_from_args
from pool.worker.flags import build_parser
from pool.worker.guards import AccessKeys
from tests.support.paths import REPO_ROOT as REPO
from tests.support.workers import TIMEOUT_S, RunningWorker
from tests.support.workers import start_worker as _start_worker
from tests.support.workers import worker_config as _config

ADMIN = "admin-0123456789abcdef"
API = "api-fedcba9876543210"
COMPLETION = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()


def _keys(admin: str | None = ADMIN, api: str | None = API) -> AccessKeys:
    return AccessKeys(
        admin=None if admin is None else BearerKey(admin, "test"),
        api=None if api is None else BearerKey(api, "test"),
    )


@pytest.fixture(scope="module")
def keyed() -> Iterator[RunningWorker]:
    running = _start_worker(_config(20, events=None, replay=None, keys=_keys()))
    yield running
    running.stop()


def call(
    http_url: str, method: str, path: str, key: str | None = None, **headers: str
) -> tuple[int, dict[str, str], Any]:
    host, port = http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    if key is not None:
        headers["Authorization"] = key if " " in key else f"Bearer {key}"
    body = COMPLETION if path == "/v1/completions" else None
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        return response.status, dict(response.headers), json.loads(raw)
    except ValueError:
        return response.status, dict(response.headers), raw.decode()


@pytest.mark.parametrize(
    ("method", "path", "key", "status"),
    [
        ("GET", "/v1/snapshot", None, 401),
        ("GET", "/v1/snapshot", "wrong", 401),
        ("GET", "/v1/snapshot", API, 401),
        ("GET", "/v1/snapshot", ADMIN.upper(), 401),
        ("GET", "/v1/snapshot", f"Basic {ADMIN}", 401),
        ("GET", "/v1/snapshot", ADMIN, 200),
        ("GET", "/v1/snapshot", f"bearer {ADMIN}", 200),
        ("POST", "/v1/reset_prefix_cache", None, 401),
        ("POST", "/v1/reset_prefix_cache", API, 401),
        ("POST", "/v1/reset_prefix_cache", ADMIN, 200),
        ("POST", "/v1/completions", None, 401),
        ("POST", "/v1/completions", "wrong", 401),
        ("POST", "/v1/completions", API, 200),
        ("POST", "/v1/completions", ADMIN, 200),  # the admin key opens everything
        ("GET", "/health", None, 200),
        ("GET", "/ready", None, 200),
        ("GET", "/metrics", None, 200),
    ],
)
def test_each_endpoint_asks_for_its_key(
    keyed: RunningWorker, method: str, path: str, key: str | None, status: int
) -> None:
    code, headers, body = call(keyed.http, method, path, key)
    assert code == status, body
    if status != 401:
        return
    assert body["error"]["type"] == "authentication_error"
    which = "API" if path == "/v1/completions" else "admin"
    assert body["error"]["message"] == (
        f"{path} needs 'Authorization: Bearer KEY' with this worker's {which} key"
    )
    if key is None:
        assert headers["WWW-Authenticate"] == 'Bearer realm="kvroute"'
    elif key.startswith("Basic"):
        assert headers["WWW-Authenticate"] == 'Bearer realm="kvroute", error="invalid_request"'
    else:
        assert headers["WWW-Authenticate"] == 'Bearer realm="kvroute", error="invalid_token"'


def test_an_unauthenticated_request_learns_nothing_else(keyed: RunningWorker) -> None:
    """401 comes before any other check: no body parsing, no media type verdict."""
    code, _, body = call(
        keyed.http, "POST", "/v1/completions", None, **{"Content-Type": "text/plain"}
    )
    assert (code, body["error"]["type"]) == (401, "authentication_error")


def test_without_an_api_key_completions_stay_open() -> None:
    running = _start_worker(_config(20, events=None, replay=None, keys=_keys(api=None)))
    try:
        assert call(running.http, "POST", "/v1/completions")[0] == 200
        assert call(running.http, "GET", "/v1/snapshot")[0] == 401
    finally:
        running.stop()


def test_keys_come_from_files_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "admin.key").write_text(ADMIN + "\n")
    monkeypatch.setenv("KVROUTE_API_KEY", API)
    config = config_from_args(
        build_parser().parse_args(["--admin-key-file", str(tmp_path / "admin.key")])
    )
    assert config.keys.admin is not None and config.keys.admin.accepts(f"Bearer {ADMIN}")
    assert config.keys.api is not None and config.keys.api.accepts(f"Bearer {API}")
    assert ADMIN not in repr(config) and API not in repr(config)
    monkeypatch.delenv("KVROUTE_API_KEY")
    assert config_from_args(build_parser().parse_args([])).keys == AccessKeys()


def test_two_sources_of_one_key_exit_1_with_a_clear_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["--port", "0", "--events", "none", "--admin-key", "a", "--admin-key-file", "f"]
    assert main(argv) == 1
    assert "worker failed: give --admin-key or --admin-key-file, not both" in caplog.text


@pytest.mark.parametrize(
    ("host", "keys", "words"),
    [
        ("127.0.0.1", _keys(None, None), None),
        ("localhost", _keys(None, None), None),
        ("::1", _keys(None, None), None),
        ("0.0.0.0", _keys(ADMIN, None), None),
        ("0.0.0.0", _keys(None, API),
         "the HTTP API listens on '0.0.0.0', beyond loopback, without an admin key: anyone who "
         "reaches it can call /v1/reset_prefix_cache, /v1/snapshot (reset the prefix cache and "
         "read every cached token id); set --admin-key-file PATH (or $KVROUTE_ADMIN_KEY), or "
         "bind --host 127.0.0.1"),
        ("10.1.2.3", _keys(None, None),
         "the HTTP API listens on '10.1.2.3', beyond loopback, without an admin key: anyone who "
         "reaches it can call /v1/reset_prefix_cache, /v1/snapshot, /v1/chat/completions, "
         "/v1/completions (reset the prefix cache and read every cached token id, and run "
         "completions); set "
         "--admin-key-file PATH (or $KVROUTE_ADMIN_KEY) and --api-key-file PATH (or "
         "$KVROUTE_API_KEY), or bind --host 127.0.0.1"),
    ],
)  # fmt: skip
def test_an_unkeyed_api_beyond_loopback_is_warned_about(
    host: str, keys: AccessKeys, words: str | None
) -> None:
    assert exposure_warning(host, keys) == words


@pytest.mark.slow
def test_the_cli_worker_takes_its_keys_and_never_logs_them(tmp_path: Path) -> None:
    (tmp_path / "admin.key").write_text(ADMIN + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVROUTE_API_KEY": API}
    args = [sys.executable, "-m", "router.cli.main", "worker", "--port", "0", "--events", "none"]
    args += ["--num-blocks", "32", "--admin-key-file", str(tmp_path / "admin.key")]
    args += ["--log-level", "DEBUG"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["http"]
        assert call(url, "GET", "/v1/snapshot")[0] == 401
        assert call(url, "GET", "/v1/snapshot", ADMIN)[0] == 200
        assert call(url, "POST", "/v1/completions")[0] == 401
        assert call(url, "POST", "/v1/completions", API)[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    assert "refused GET /v1/snapshot" in log  # the refusal is logged, the key never
    assert ADMIN not in log and API not in log
    assert "beyond loopback" not in log
