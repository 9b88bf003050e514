"""Hosts in Linux network namespaces on one bridge: real multi-host networking on one box.

A :class:`Network` makes a *switch* namespace holding a bridge, and one namespace per
host, each joined to the bridge by a veth pair created directly inside the namespaces
(nothing is ever added to the test process's own namespace: no interface, address or
route). Hosts get addresses in ``10.213.0.0/24``; since every address lives only inside
namespaces this network made, two networks (or two test runs) never see each other.

Invariants:
- Every namespace a network made is deleted by :meth:`Network.close` (and by leaving the
  ``with`` block), also when a test fails half way; deleting a namespace removes its
  veth ends and kills nothing else. Processes started in a namespace are the caller's to
  stop (``tests.support.workers`` process groups do that) before the network closes.
- The test process talks to a host through :meth:`Host.call`, which runs a function on a
  fresh thread moved into the host's namespace (``setns`` moves only that thread), so
  sockets it opens live in that namespace.

Tests that cannot create namespaces (not root, no ``ip``) are skipped with the reason,
through :func:`require_namespaces`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

SUBNET_PREFIX = "10.213.0."
"""Host ``i`` (from 1) gets ``10.213.0.{i + 1}``; the /24 exists only inside the namespaces."""
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def ip(
    *argv: str, netns: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``ip argv`` (inside ``netns`` when given); raise with stderr on failure."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    done = subprocess.run(
        [*prefix, "ip", *argv], capture_output=True, text=True, timeout=30, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)} (netns {netns}): {done.stderr.strip()}")
    return done


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"kvprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_namespaces() -> None:
    """Skip the calling test, with the reason, where namespaces cannot be created."""
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")


def netem_unavailable(network: Network) -> str | None:
    """Why ``tc netem`` cannot shape a link here (the kernel lacks sch_netem), or None."""
    if shutil.which("tc") is None:
        return "the 'tc' command is not installed"
    host = network.hosts[0]
    done = host.run(["tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "1ms"])
    if done.returncode != 0:
        return f"tc netem is not available in this kernel: {done.stderr.strip()}"
    host.run(["tc", "qdisc", "del", "dev", "eth0", "root"])
    return None


@dataclass(frozen=True)
class Host:
    """One machine: a namespace with ``lo`` and ``eth0`` (``address``/24) on the bridge.

    ``port`` is the bridge-side veth end, in the switch namespace."""

    name: str
    address: str
    switch: str
    port: str

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a command inside this host and wait for it (never raises on exit status)."""
        return subprocess.run(
            self.argv(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on a new thread inside this host's namespace; return its
        result or raise its exception. Sockets opened by ``fn`` stay in the namespace."""
        box: dict[str, Any] = {}

        def inside() -> None:
            fd = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {self.name}")
            finally:
                os.close(fd)
            try:
                box["result"] = fn(*args)
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=inside, name=f"netns-{self.name}", daemon=True)
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["result"]  # type: ignore[no-any-return]

    def link_down(self) -> None:
        """Cut this host off the bridge (its own side stays up: a silent partition)."""
        ip("link", "set", self.port, "down", netns=self.switch)

    def link_up(self) -> None:
        """Reconnect this host to the bridge."""
        ip("link", "set", self.port, "up", netns=self.switch)

    def kill_tcp(self, peer: str) -> None:
        """Destroy this host's side of every TCP connection to ``peer`` (as a kernel that
        gave up retransmitting, or a NAT that forgot the flow, leaves it): the peer's side
        stays ESTABLISHED until it sends something."""
        done = self.run(["ss", "-K", "dst", peer])
        if done.returncode != 0:
            raise RuntimeError(f"ss -K in {self.name}: {done.stderr.strip()}")


@dataclass
class Network:
    """A bridge and the hosts on it; a context manager that removes all it made."""

    tag: str = field(default_factory=lambda: f"kv{os.getpid() % 100000}")
    hosts: list[Host] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}sw"

    def __enter__(self) -> Network:
        require_namespaces()
        self._add_namespace(self.switch)
        ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        ip("link", "set", "br0", "up", netns=self.switch)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        ip("netns", "del", name, check=False)  # a leftover of a killed run
        ip("netns", "add", name)
        self._made.append(name)
        ip("link", "set", "lo", "up", netns=name)

    def add_host(self, label: str) -> Host:
        """A new host ``{tag}{label}`` with the next address on the bridge."""
        index = len(self.hosts) + 1
        host = Host(
            name=f"{self.tag}{label}",
            address=f"{SUBNET_PREFIX}{index + 1}",
            switch=self.switch,
            port=f"p{index}",
        )
        self._add_namespace(host.name)
        ip("link", "add", "name", "eth0", "netns", host.name, "type", "veth",
           "peer", "name", host.port, "netns", self.switch)  # fmt: skip
        ip("link", "set", host.port, "master", "br0", netns=self.switch)
        ip("link", "set", host.port, "up", netns=self.switch)
        ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.name)
        ip("link", "set", "eth0", "up", netns=host.name)
        self.hosts.append(host)
        return host

    def close(self) -> None:
        """Delete every namespace made (hosts first, then the switch); idempotent."""
        while self._made:
            ip("netns", "del", self._made.pop(), check=False)
