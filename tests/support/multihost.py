"""The fault cluster spread over hosts: every process in its own network namespace.

:class:`MultiHostCluster` is :class:`tests.support.faults.Cluster` with each process
(Redis, each router replica, each worker, by name) on a host of its own in a
:class:`tests.support.netns.Network`, listening on that host's address, and the test's
clients (health waits, requests, scrapes, ``kvroute index check``, :class:`Load`) on a
host called ``client``. A host is made the first time a process of its name is placed, so
``cluster.hosts[name]`` is the handle to cut that process's link.

Invariants:
- Leaving the ``with`` block stops every process (the cluster's process group), then
  removes every namespace, also when the test failed half way or a start raised.
- Nothing listens on, or connects to, an address outside the network's namespaces.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from router.store.server import find_redis_server, free_port, ping
from tests.support.faults import CLIENT, REDIS, Cluster, Load
from tests.support.netns import Host, Network
from tests.support.polling import wait_until
from tests.support.redis_cluster import ClusterNode, cluster_args, form_cluster

REDIS_START_S = 30.0
T = TypeVar("T")


class MultiHostCluster(Cluster):
    """A :class:`Cluster` whose processes each run on their own host; a context manager.

    Args:
        log_dir: Where each process logs.
        num_workers: kvroute workers ``w0 .. w{n-1}``, on hosts ``w0 ..``.
        redis_masters: 1: one Redis server; more: a Redis Cluster of that many masters,
            on hosts ``redis``, ``redis1`` .. (its URL names the first).
    """

    def __init__(self, log_dir: Path, num_workers: int = 3, redis_masters: int = 1) -> None:
        super().__init__(log_dir, num_workers)
        self.redis_masters = redis_masters
        self.network = Network()
        self.hosts: dict[str, Host] = {}

    def host(self, name: str) -> Host:
        """The host of process ``name`` (made on first use)."""
        if name not in self.hosts:
            self.hosts[name] = self.network.add_host(name)
        return self.hosts[name]

    def address(self, name: str) -> str:
        return self.host(name).address

    def place(self, name: str, argv: list[str]) -> list[str]:
        return self.host(name).argv(argv)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return self.host(CLIENT).call(fn, *args)

    def load(self, urls: list[str], clients: int = 4, seed: int = 0) -> Load:
        """Closed-loop clients on the client host (enter it to start them)."""
        return Load(urls, clients=clients, seed=seed, runner=self.host(CLIENT).call)

    def start_redis(self) -> None:
        """Start the empty Redis (or Redis Cluster, formed and ``ok``) of the cluster."""
        if self.redis_masters == 1:
            self.start_redis_server(REDIS)
            return
        nodes = []
        for i in range(self.redis_masters):
            name = REDIS if i == 0 else f"{REDIS}{i}"
            bus_port = next(p for p in iter(free_port, None) if p != self.redis_port)
            node = ClusterNode(self.address(name), self.redis_port, bus_port)
            self.start_redis_server(name, *cluster_args(node, f"nodes-{name}.conf"))
            nodes.append(node)
        self.call(form_cluster, nodes, REDIS_START_S)

    def start_redis_server(self, name: str, *extra: str) -> None:
        """Start an empty ``redis-server`` on host ``name``, on the cluster's Redis port,
        and wait for its ``PING``; ``extra``: more ``redis-server`` arguments."""
        port = self.redis_port
        address = self.address(name)
        argv = [
            find_redis_server(), "--bind", address, "--port", str(port), "--save", "",
            "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.group.log_dir),
            *extra,
        ]  # fmt: skip
        self.group.log_dir.mkdir(parents=True, exist_ok=True)
        self.group.start(name, self.place(name, argv))

        def answers() -> bool:
            self.group.check_alive()
            return self.call(ping, address, port)

        wait_until(answers, f"{name} to answer PING at {address}:{port}", timeout_s=REDIS_START_S)

    def stop_redis(self) -> None:
        """Kill Redis; its data is gone (no persistence)."""
        self.kill(REDIS)

    def __enter__(self) -> MultiHostCluster:
        self.network.__enter__()
        try:
            super().__enter__()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.network.close()
