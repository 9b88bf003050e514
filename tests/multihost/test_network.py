"""The namespace network the multi-host tier stands on: hosts reach each other by address
over the bridge, a cut link stops traffic until it is back, and nothing is left behind."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.support.netns import Host, Network


def listen(host: Host) -> socket.socket:
    """A TCP listener bound to the host's own address (port chosen by the kernel)."""

    def make() -> socket.socket:
        server = socket.create_server((host.address, 0))
        server.settimeout(10)
        return server

    return host.call(make)


def connect(host: Host, address: str, port: int, timeout_s: float) -> socket.socket:
    return host.call(socket.create_connection, (address, port), timeout_s)


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_hosts_talk_by_address_and_a_cut_link_stops_traffic() -> None:
    with Network() as net:
        a, b = net.add_host("a"), net.add_host("b")
        assert a.address != b.address
        server = listen(b)
        port = server.getsockname()[1]
        client = connect(a, b.address, port, 10)
        conn, peer = server.accept()
        assert peer[0] == a.address
        client.sendall(b"ping")
        assert conn.recv(4) == b"ping"
        b.link_down()
        with pytest.raises(OSError):  # SYNs go nowhere while the link is down
            connect(a, b.address, port, 1.0)
        b.link_up()
        again = connect(a, b.address, port, 10)
        server.accept()[0].close()
        for s in (client, conn, again, server):
            s.close()
        made = {a.name, b.name, net.switch}
        assert made <= namespaces()
    assert not made & namespaces()


def test_namespaces_are_removed_when_the_test_fails() -> None:
    net = Network(tag="kvfail")
    with pytest.raises(RuntimeError, match="boom"), net:
        net.add_host("x")
        raise RuntimeError("boom")
    assert not {"kvfailx", "kvfailsw"} & namespaces()
