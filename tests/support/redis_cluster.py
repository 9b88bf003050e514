"""Forming a Redis Cluster from empty ``cluster-enabled`` servers: slots and membership.

:func:`form_cluster` gives each master an equal share of the 16384 hash slots, makes every
node meet the first, and waits until each reports ``cluster_state:ok`` with every node
known. The servers are the caller's (on loopback, or one per host in namespaces).
:func:`redis_cluster` starts and forms a private three-master cluster on loopback, for the
session fixture of the router tests and for the tests that break a shard of their own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from router.store.server import RedisServer, free_port
from tests.support.polling import wait_until

NUM_SLOTS = 16384


@dataclass(frozen=True)
class ClusterNode:
    """A cluster-enabled server: where clients and where the cluster bus reach it."""

    host: str
    port: int
    bus_port: int


def cluster_args(node: ClusterNode, config_file: str = "nodes.conf") -> list[str]:
    """``redis-server`` arguments that make ``node`` a cluster member (its own nodes file)."""
    return [
        "--cluster-enabled", "yes", "--cluster-config-file", config_file,
        "--cluster-port", str(node.bus_port),
    ]  # fmt: skip


def slot_ranges(num_masters: int) -> list[tuple[int, int]]:
    """The slots of each master: consecutive, as equal as can be, covering them all."""
    bounds = [NUM_SLOTS * i // num_masters for i in range(num_masters + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(num_masters)]


def _info(client: redis.Redis) -> dict[str, str]:
    info = client.cluster("INFO")
    if isinstance(info, dict):
        return {str(k): str(v) for k, v in info.items()}
    return dict(line.split(":", 1) for line in info.decode().split() if ":" in line)


def form_cluster(nodes: Sequence[ClusterNode], timeout_s: float) -> None:
    """Make the nodes (each an empty master) one cluster, and wait until it is ``ok``."""
    clients = [redis.Redis(host=n.host, port=n.port) for n in nodes]
    try:
        for client, (first, last) in zip(clients, slot_ranges(len(nodes)), strict=True):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for node in nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", node.host, node.port, node.bus_port)

        def converged() -> bool:
            return all(
                i.get("cluster_state") == "ok"
                and int(i.get("cluster_known_nodes", 0)) == len(nodes)
                for i in map(_info, clients)
            )

        wait_until(converged, "the Redis Cluster to converge", timeout_s=timeout_s)
    finally:
        for client in clients:
            client.close()


SLOT_RANGES = tuple(slot_ranges(3))
"""The slots of each master of :func:`redis_cluster`, in the order of its servers."""


@contextmanager
def redis_cluster(timeout_s: float = 30.0) -> Iterator[list[RedisServer]]:
    """Start three empty masters on loopback and form them into a cluster (slots as
    :data:`SLOT_RANGES`); yields their servers, stopped on exit."""
    nodes = [ClusterNode("127.0.0.1", free_port(), free_port()) for _ in SLOT_RANGES]
    servers = [RedisServer(port=n.port, extra_args=cluster_args(n)) for n in nodes]
    try:
        for server in servers:
            server.start()
        form_cluster(nodes, timeout_s=timeout_s)
        yield servers
    finally:
        for server in servers:
            server.stop()
