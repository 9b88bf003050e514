"""A secured cluster across hosts: CURVE-authenticated event streams and the router's
HTTP credentials, with every process on its own host.

The router requires CURVE (``--require-curve``: only workers registered with their
server key are admitted, so only the holder of a worker's secret key can publish its
events), guards inference with ``--api-key`` and registration with ``--admin-key``, and
admits only workers on the hosts' network (``--allow-worker-net``). Each worker allows
only the router's public key and guards its own endpoints with the workers' keys, which
the router sends (``--worker-api-key-file`` with each request, ``--worker-admin-key-file``
to read snapshots). Events flow over CURVE between hosts (cached prefixes are routed to and
the index is exact), a worker registered over HTTP with its server key is served too, and
every request without its credential, or for a worker outside the allowed network or
without a server key, is refused.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from events.curve import load_public_key
from tests.support.faults import (
    REQUEST_TIMEOUT_S,
    post_json,
    python_m,
    unique_prompts,
    wait_converged,
)
from tests.support.multihost import MultiHostCluster
from tests.support.netns import SUBNET_PREFIX

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

CONVERGE_BOUND_S = 60.0
API_KEY = "api-key-for-the-multihost-test"
ADMIN_KEY = "admin-key-for-the-multihost-test"
WORKER_KEYS = {"worker_api": "workers-api-key-between-hosts",
               "worker_admin": "workers-admin-key-between-hosts"}  # fmt: skip
NET = f"{SUBNET_PREFIX}0/24"
MIN_CACHED_TOKENS = 16
"""A repeated 24-token prompt hits at least 4 of its 4-token blocks."""


def make_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """A CURVE key pair from ``kvroute keys``: (public, secret) files."""
    subprocess.run(
        python_m("keys", "--out", str(directory), "--name", name),
        check=True, capture_output=True, timeout=REQUEST_TIMEOUT_S,
    )  # fmt: skip
    return directory / f"{name}.key", directory / f"{name}.key_secret"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_curve_and_http_credentials_between_hosts(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    router_public, router_secret = make_keys(keys, "router")
    for name, key in (("api", API_KEY), ("admin", ADMIN_KEY), *WORKER_KEYS.items()):
        (keys / name).write_text(key + "\n")
    with MultiHostCluster(tmp_path / "logs", num_workers=2) as cluster:
        w0, w1 = cluster.workers
        public = {}
        for w in (w0, w1):
            public[w.worker_id], secret = make_keys(keys, w.worker_id)
            cluster.start_worker(
                w, "--curve-secret-key", str(secret), "--curve-allow", str(router_public),
                "--api-key-file", str(keys / "worker_api"),
                "--admin-key-file", str(keys / "worker_admin"),
            )  # fmt: skip
        cluster.check_args = ["--worker-admin-key-file", str(keys / "worker_admin")]
        router = cluster.start_router(
            "r0", [f"{w0.spec()},server_key={public['w0']}"],
            "--require-curve", "--client-key", str(router_secret),
            "--api-key-file", str(keys / "api"), "--admin-key-file", str(keys / "admin"),
            "--allow-worker-net", NET,
            "--worker-api-key-file", str(keys / "worker_api"),
            "--worker-admin-key-file", str(keys / "worker_admin"),
        )  # fmt: skip
        cluster.wait_healthy([w0.url, w1.url, router])

        def post(
            path: str, body: dict[str, object], key: str | None
        ) -> tuple[int, str, dict[str, Any]]:
            """Status, serving worker and JSON answer of a POST to the router."""
            headers = bearer(key) if key is not None else None
            code, got, answer, _ = cluster.call(post_json, f"{router}{path}", body, headers)
            return code, got.get("X-Kvroute-Worker", ""), answer

        registration = {
            "worker_id": "w1", "url": w1.url, "events": w1.events_endpoint,
            "replay": w1.replay_endpoint, "block_size": 4,
            "server_key": load_public_key(public["w1"]).decode(),
        }  # fmt: skip
        refused = {
            "no admin key": post("/v1/workers", registration, API_KEY),
            "outside the net": post(
                "/v1/workers", {**registration, "url": "http://192.0.2.1:8000"}, ADMIN_KEY
            ),
            "no server key": post(
                "/v1/workers", {k: v for k, v in registration.items() if k != "server_key"},
                ADMIN_KEY,
            ),
        }  # fmt: skip
        added = post("/v1/workers", registration, ADMIN_KEY)
        workers = [(w.worker_id, w.url) for w in cluster.workers]
        prompts = {"w0": list(range(24)), "w1": list(range(100, 124))}
        to_worker = bearer(WORKER_KEYS["worker_api"])
        for wid, w in (("w0", w0), ("w1", w1)):  # computed on each worker directly
            cluster.call(
                post_json, f"{w.url}/v1/completions", {"prompt": prompts[wid]}, to_worker
            )
        anonymous = post("/v1/completions", {"prompt": prompts["w0"]}, None)
        unkeyed = cluster.call(post_json, f"{w0.url}/v1/completions", {"prompt": [1, 2]})
        fresh = unique_prompts(5, num_blocks=2)

        def poke() -> None:
            # A batch that shows a gap if one went unseen meanwhile; then the prompt to
            # be routed again, so it stays the most recent thing in the worker's cache
            # (a slow convergence makes many pokes, which would otherwise evict it).
            for w in (w0, w1):
                for prompt in (next(fresh), prompts[w.worker_id]):
                    body = {"prompt": prompt}
                    cluster.call(post_json, f"{w.url}/v1/completions", body, to_worker)

        # Their events came over CURVE.
        wait_converged(cluster, workers, CONVERGE_BOUND_S, poke=poke)
        routed = {
            wid: post("/v1/completions", {"prompt": p}, API_KEY) for wid, p in prompts.items()
        }
    assert refused["no admin key"][0] == 401
    assert refused["outside the net"][0] == 400
    assert "outside the networks this router may reach" in str(refused["outside the net"][2])
    assert refused["no server key"][0] == 400
    assert "has no server_key" in str(refused["no server key"][2])
    assert added[0] == 201
    assert anonymous[0] == 401
    assert unkeyed[0] == 401  # the workers answer only whoever holds their keys
    for wid, (code, worker, answer) in routed.items():  # each to the worker that holds it
        assert (code, worker) == (200, wid)
        assert answer["usage"]["cached_tokens"] >= MIN_CACHED_TOKENS
