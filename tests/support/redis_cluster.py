"""A private three-master Redis Cluster on free loopback ports (no replicas).

Shared by the session fixture of the router tests and by the tests that break a shard of
a cluster of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from router.store.server import RedisServer, free_port
from tests.support.polling import wait_until

SLOT_RANGES = ((0, 5460), (5461, 10922), (10923, 16383))
"""The slots of each master, in the order of the servers."""


def _wait_cluster_ok(clients: list[redis.Redis], timeout_s: float) -> None:
    def converged() -> bool:
        infos = [c.cluster("INFO") for c in clients]
        states = [
            i
            if isinstance(i, dict)
            else dict(line.split(":", 1) for line in i.decode().split() if ":" in line)
            for i in infos
        ]
        return all(
            str(s.get("cluster_state")) == "ok" and int(s.get("cluster_known_nodes", 0)) == 3
            for s in states
        )

    wait_until(converged, "the Redis Cluster to converge", timeout_s=timeout_s)


@contextmanager
def redis_cluster() -> Iterator[list[RedisServer]]:
    """Start the cluster (slots assigned as :data:`SLOT_RANGES`); yields its servers."""
    bus_ports = [free_port() for _ in SLOT_RANGES]
    args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    servers = [
        RedisServer(extra_args=[*args, "--cluster-port", str(bus_port)]) for bus_port in bus_ports
    ]
    try:
        for server in servers:
            server.start()
        clients = [redis.Redis(host=s.host, port=s.port) for s in servers]
        for client, (first, last) in zip(clients, SLOT_RANGES, strict=True):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for server, bus_port in zip(servers[1:], bus_ports[1:], strict=True):
            clients[0].execute_command("CLUSTER", "MEET", server.host, server.port, bus_port)
        _wait_cluster_ok(clients, timeout_s=30.0)
        for client in clients:
            client.close()
        yield servers
    finally:
        for server in servers:
            server.stop()
