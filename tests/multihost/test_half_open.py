"""A half-open event connection across hosts is noticed and the index repaired.

Redis and a router on hosts of their own, one kvroute worker on another. While the
worker's link is down its side of the router's event connection is destroyed (``ss -K``:
as its kernel does when it gives up retransmitting, or a NAT that forgets the flow); its
reset never reaches the router, whose side stays ESTABLISHED. The link comes back and the
worker serves requests whose events go into nothing. The router's heartbeats find the
connection dead and make it again, and its watchdog finds the batches the worker
published meanwhile: ``kvroute index check`` reaches 0 divergent within
:data:`CONVERGE_BOUND_S`.

Both for the worker registered as a kvroute worker (position from ``GET /health``,
snapshot) and as a vLLM-protocol publisher (``kind=vllm``: the router sees only its vLLM
wire stream and replay endpoint, as for a vLLM engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from tests.support.faults import complete, family_prompts, metric, scrape, wait_converged
from tests.support.multihost import MultiHostCluster
from tests.support.netns import Host

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

CONVERGE_BOUND_S = 45.0
"""From the last request after the cut to 0 divergent, with the default flags: one
heartbeat interval (5 s: the first ``PING`` meets the worker's reset and the connection
is made again) and a round of the idle watchdog (1 s), which checks a reconnected stream
at once; at worst the idle bound (30 s) catches what that missed. The rest is room for a
loaded 2-core machine (``kvroute index check`` runs take about a second each)."""


def established(host: Host, peer: str) -> list[str]:
    """The host's ESTABLISHED TCP connections to ``peer``, as ``ss`` lists them."""
    done = host.run(["ss", "-Htn", "state", "established", "dst", peer])
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("kind", ["kvroute", "vllm"])
def test_a_half_open_event_connection_is_noticed_and_the_index_converges(
    tmp_path: Path, kind: Literal["kvroute", "vllm"]
) -> None:
    with MultiHostCluster(tmp_path, num_workers=1) as cluster:
        cluster.start_workers()
        w0 = cluster.workers[0]
        spec = w0.spec() + (",kind=vllm" if kind == "vllm" else "")
        extra = ["--tokenize-via-engine"] if kind == "vllm" else []
        router = cluster.start_router("r0", [spec], *extra)  # liveness flags: defaults
        cluster.wait_healthy([router])
        workers = [(w0.worker_id, w0.url)]
        prompts = family_prompts(3, 8)
        for prompt in prompts[:4]:
            cluster.call(complete, w0.url, prompt)
        wait_converged(cluster, workers, CONVERGE_BOUND_S)
        worker_host, router_host = cluster.hosts["w0"], cluster.hosts["r0"]
        router_address = cluster.address("r0")
        assert established(router_host, f"{w0.host}:{w0.events}")
        worker_host.link_down()
        worker_host.kill_tcp(router_address)  # its reset is lost on the cut link
        assert established(worker_host, router_address) == []
        assert established(router_host, f"{w0.host}:{w0.events}"), "half-open"
        worker_host.link_up()
        for prompt in prompts[4:]:
            cluster.call(complete, w0.url, prompt)  # their events reach no subscriber
        took_s = wait_converged(cluster, workers, CONVERGE_BOUND_S)
        samples = cluster.call(scrape, router)
    assert took_s < CONVERGE_BOUND_S
    # The lost batches came back through a replay: asked by the watchdog (the stream
    # reconnected, or quiet), or by the gap a live batch showed after the reconnection.
    replayed = metric(samples, "kvroute_ingest_idle_checks_total", worker="w0", outcome="replayed")
    gaps = metric(samples, "kvroute_stream_gaps_total", worker="w0")
    assert replayed + gaps >= 1
