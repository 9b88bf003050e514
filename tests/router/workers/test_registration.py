"""Registration checks: what a WorkerRecord may hold, and what one router's policy admits."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import msgspec
import pytest

from events.curve import CurveKeyPair
from router.workers.registration import (
    MAX_BLOCK_SIZE,
    RegistrationConflict,
    RegistrationError,
    RegistrationPolicy,
    parse_allowed_net,
)
from router.workers.registry import WorkerRecord

KEY = CurveKeyPair.generate().public_key.decode()
GOOD: dict[str, Any] = {"worker_id": "w1", "events_endpoint": "tcp://10.0.0.5:5557"}


def record(**fields: Any) -> WorkerRecord:
    return WorkerRecord(**{**GOOD, **fields})


@pytest.mark.parametrize(
    "fields",
    [
        {"events_endpoint": "tcp://worker-3.cluster.local:5557"},
        {"events_endpoint": "tcp://[fd00::5]:65535", "replay_endpoint": "tcp://10.0.0.5:1"},
        {"events_endpoint": "ipc:///run/kvroute/w1.sock"},
        {"events_endpoint": "ipc://@kvroute-abstract"},
        {"http_url": "https://w1.example:8443"},
        {"http_url": "http://[fd00::5]:8000"},
        {"http_url": "http://w1"},  # the scheme's default port
        {"block_size": 1},
        {"block_size": MAX_BLOCK_SIZE},
        {"server_key": KEY},
        {"worker_id": "pod-7.rack_2:gpu@node", "topic": "kv-events"},
    ],
)
def test_valid_records_are_accepted(fields: dict[str, Any]) -> None:
    assert record(**fields) == msgspec.convert({**GOOD, **fields}, WorkerRecord)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"events_endpoint": "garbage"}, "events endpoint 'garbage': expected tcp://HOST:PORT or ipc://PATH"),
        ({"replay_endpoint": "garbage"}, "replay endpoint 'garbage': expected tcp://HOST:PORT"),
        ({"events_endpoint": "tcp://10.0.0.5"}, "expected tcp://HOST:PORT"),
        ({"events_endpoint": "tcp://10.0.0.5:*"}, "expected tcp://HOST:PORT"),
        ({"events_endpoint": "tcp://10.0.0.5:0"}, "port '0' is not in 1-65535"),
        ({"events_endpoint": "tcp://10.0.0.5:65536"}, "port '65536' is not in 1-65535"),
        ({"events_endpoint": "tcp://:5557"}, "the host is empty"),
        ({"events_endpoint": "tcp://*:5557"}, "'*' is a wildcard (a bind address)"),
        ({"events_endpoint": "tcp://0.0.0.0:5557"}, "'0.0.0.0' is a wildcard"),
        ({"replay_endpoint": "tcp://[::]:5558"}, "'::' is a wildcard"),
        ({"events_endpoint": "tcp://eth0;10.0.0.5:5557"}, "is not a host name or IP address"),
        ({"events_endpoint": "tcp://[zz]:5557"}, "'zz' is not an IPv6 address"),
        ({"events_endpoint": "inproc://w1"}, "inproc:// reaches only sockets inside the router"),
        ({"events_endpoint": "ipc://"}, "expected ipc://PATH"),
        ({"events_endpoint": "ipc://" + "p" * 108}, "a path of 1-107 printable characters"),
        ({"http_url": "http://"}, "url 'http://': the host is empty"),
        ({"http_url": "http://h:99999"}, "url 'http://h:99999': Port out of range"),
        ({"http_url": "http://h:0"}, "the port is missing or 0"),
        ({"http_url": "http://h:"}, "the port is missing or 0"),
        ({"http_url": "ftp://h:21"}, "must start with http:// or https://"),
        ({"http_url": "h:8000"}, "must start with http:// or https://"),
        ({"http_url": "http://0.0.0.0:8000"}, "'0.0.0.0' is a wildcard"),
        ({"http_url": "http://user:pw@h:8000"}, "credentials in the URL are not accepted"),
        ({"http_url": "http://a b:8000"}, "'a b' is not a host name or IP address"),
        ({"block_size": 0}, "block_size must be 1-4096 tokens"),
        ({"block_size": MAX_BLOCK_SIZE + 1}, "block_size must be 1-4096 tokens"),
        ({"worker_id": "a b"}, "worker id 'a b' is not valid"),
        ({"worker_id": "w" * 129}, "is not valid: use 1-128 characters"),
        ({"worker_id": ""}, "worker id '' is not valid"),
        ({"topic": "kv\n"}, "topic must be at most 256 printable characters"),
        ({"topic": "t" * 257}, "topic must be at most 256 printable characters"),
        ({"server_key": "short"}, "server_key must be a z85 CURVE public key of 40"),
        ({"server_key": "~" * 40}, "server_key must be a z85 CURVE public key of 40"),
        ({"server_key": "%" * 40}, "server_key must be a z85 CURVE public key of 40"),
        ({"server_key": "\u00e9" * 40}, "server_key must be a z85 CURVE public key of 40"),
    ],
)  # fmt: skip
def test_invalid_records_are_refused_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RegistrationError) as info:
        record(**fields)
    assert message in str(info.value)
    # Decoding (a record read back from Redis) runs the same check.
    with pytest.raises(msgspec.ValidationError) as decoded:
        msgspec.json.decode(msgspec.json.encode({**GOOD, **fields}), type=WorkerRecord)
    assert message in str(decoded.value)


def test_url_path_query_and_fragment_are_stripped() -> None:
    assert record(http_url="http://w1:8000/v1/completions?x=1#f").http_url == "http://w1:8000"
    assert record(http_url="HTTPS://W1:8443/").http_url == "https://W1:8443"
    raw = b'{"worker_id": "w1", "events_endpoint": "tcp://h:1", "http_url": "http://h:2/p?q"}'
    assert msgspec.json.decode(raw, type=WorkerRecord).http_url == "http://h:2"


def test_allowed_nets_admit_listed_networks_and_names_only() -> None:
    policy = RegistrationPolicy.from_flags(["10.0.0.0/8", "fd00::/8", "gpu-1.internal"])
    policy.check(record(http_url="http://10.1.2.3:8000"))
    policy.check(record(events_endpoint="tcp://[fd00::9]:5557", http_url="http://GPU-1.internal"))
    policy.check(record(events_endpoint="ipc:///run/w1.sock"))  # same machine: no network
    for fields, host in [
        ({"http_url": "http://127.0.0.1:8000"}, "url host '127.0.0.1'"),
        ({"http_url": "http://gpu-2.internal:8000"}, "url host 'gpu-2.internal'"),
        ({"events_endpoint": "tcp://192.168.1.1:5557"}, "events host '192.168.1.1'"),
        ({"replay_endpoint": "tcp://[fe80::1]:5558"}, "replay host 'fe80::1'"),
    ]:
        with pytest.raises(RegistrationError) as info:
            policy.check(record(**fields))
        assert host in str(info.value)
        assert "outside the networks this router may reach (--allow-worker-net" in str(info.value)
    assert RegistrationPolicy().allowed_nets == ()
    RegistrationPolicy().check(record(http_url="http://anything:1"))


def test_allowed_net_values_are_parsed_or_refused() -> None:
    assert parse_allowed_net("10.0.0.0/8") == ipaddress.ip_network("10.0.0.0/8")
    assert parse_allowed_net("10.0.0.7") == ipaddress.ip_network("10.0.0.7/32")
    assert parse_allowed_net("Node-1.Example.") == "node-1.example"
    with pytest.raises(RegistrationError, match="expected a CIDR"):
        parse_allowed_net("10.0.0.0/99")
    with pytest.raises(RegistrationError, match="expected a CIDR"):
        parse_allowed_net("not a host")


def test_require_curve_refuses_a_worker_without_server_key() -> None:
    policy = RegistrationPolicy(require_curve=True)
    with pytest.raises(RegistrationError, match=r"has no server_key.*\(--require-curve\)"):
        policy.check(record())
    policy.check(record(server_key=KEY))


@pytest.mark.parametrize(
    ("own", "url"),
    [
        (("127.0.0.1", 8000), "http://127.0.0.1:8000"),
        (("127.0.0.1", 8000), "http://localhost:8000/v1"),
        (("127.0.0.1", 8000), "http://127.0.0.2:8000"),
        (("127.0.0.1", 8000), "http://[::1]:8000"),
        (("0.0.0.0", 8000), "http://127.0.0.1:8000"),
        (("0.0.0.0", 8000), f"http://{socket.gethostname()}:8000"),
        (("10.0.0.1", 80), "http://10.0.0.1"),
        (("router.internal", 8000), "http://ROUTER.internal:8000"),
    ],
)
def test_the_routers_own_address_is_refused(own: tuple[str, int], url: str) -> None:
    with pytest.raises(RegistrationError, match="is this router's own address"):
        RegistrationPolicy(own_address=own).check(record(http_url=url))


def test_other_ports_and_hosts_are_not_the_router() -> None:
    policy = RegistrationPolicy(own_address=("127.0.0.1", 8000))
    policy.check(record(http_url="http://127.0.0.1:8001"))
    policy.check(record(http_url="http://10.0.0.1:8000"))
    RegistrationPolicy(own_address=("10.0.0.1", 8000)).check(record(http_url="http://[::1]:8000"))


def test_a_conflict_names_each_differing_field() -> None:
    saved = record(http_url="http://h:1")
    wanted = record(http_url="http://h:2", topic="kv")
    conflict = RegistrationConflict(wanted, saved)
    assert conflict.differences == {"http_url": ("http://h:1", "http://h:2"), "topic": ("", "kv")}
    assert str(conflict) == (
        "worker 'w1': it is registered with other settings: http_url 'http://h:1' (saved) vs "
        "'http://h:2' (requested), topic '' (saved) vs 'kv' (requested)"
    )
    unusable = RegistrationConflict(wanted, None, "bad JSON")
    assert (unusable.differences, str(unusable)) == (
        {},
        "worker 'w1': an unusable registration is saved (bad JSON)",
    )
