"""The addresses a worker announces: the advertised host in place of the bound one, a wildcard
never registered, and the flags that set them."""

from __future__ import annotations

import pytest

from pool.worker.addresses import AddressError, WorkerAddresses, check_advertise_host
from pool.worker.config import WorkerConfig, config_from_args
from pool.worker.flags import build_parser
from pool.worker.router_registration import RegistrationRefusedError, registration_body


def test_the_advertised_host_replaces_every_bound_host_and_keeps_the_ports() -> None:
    bound = WorkerAddresses.bound("0.0.0.0", 8100, "tcp://0.0.0.0:5557", "tcp://0.0.0.0:5558")
    assert bound.wildcards == [
        "http://0.0.0.0:8100",
        "tcp://0.0.0.0:5557",
        "tcp://0.0.0.0:5558",
    ]
    assert bound.advertised("worker-a").as_dict() == {
        "http": "http://worker-a:8100",
        "events": "tcp://worker-a:5557",
        "replay": "tcp://worker-a:5558",
    }
    assert bound.advertised("worker-a").wildcards == []
    assert bound.advertised(None) == bound


def test_ipv6_hosts_are_bracketed_and_ipc_endpoints_stay_as_they_are() -> None:
    bound = WorkerAddresses.bound("::", 8100, "tcp://[::]:5557", "ipc:///run/kv/replay")
    assert bound.wildcards == ["http://[::]:8100", "tcp://[::]:5557"]
    assert bound.advertised("fd00::5").as_dict() == {
        "http": "http://[fd00::5]:8100",
        "events": "tcp://[fd00::5]:5557",
        "replay": "ipc:///run/kv/replay",
    }
    # Before the bind a port may still be '*': the host is checked all the same.
    assert WorkerAddresses.bound("127.0.0.1", 0, "tcp://*:*", None).wildcards == ["tcp://*:*"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "*", ""])
def test_a_wildcard_advertise_host_is_refused(host: str) -> None:
    with pytest.raises(AddressError, match="is a wildcard: it must be the address other hosts"):
        check_advertise_host(host)


def test_an_advertise_host_must_look_like_a_host() -> None:
    assert check_advertise_host("[fd00::5]") == "fd00::5"
    assert check_advertise_host("worker-0.kvroute-worker") == "worker-0.kvroute-worker"
    with pytest.raises(AddressError, match="is not a host name or IP address"):
        check_advertise_host("http://worker-a")


def body_of(addresses: WorkerAddresses) -> dict[str, object]:
    return registration_body(
        "w0", addresses, topic="kv", block_size=16, models=("m",), server_key=None
    )


def test_the_registration_body_carries_the_advertised_addresses() -> None:
    bound = WorkerAddresses.bound("0.0.0.0", 8100, "tcp://0.0.0.0:5557", None)
    assert body_of(bound.advertised("10.0.0.5")) == {
        "worker_id": "w0",
        "url": "http://10.0.0.5:8100",
        "events": "tcp://10.0.0.5:5557",
        "replay": None,
        "topic": "kv",
        "block_size": 16,
        "models": ["m"],
    }


def test_a_wildcard_or_a_worker_without_events_is_never_registered() -> None:
    bound = WorkerAddresses.bound("0.0.0.0", 8100, "tcp://127.0.0.1:5557", None)
    with pytest.raises(RegistrationRefusedError) as info:
        body_of(bound)
    assert str(info.value) == (
        "cannot register http://0.0.0.0:8100 with a router: a wildcard is a bind address "
        "nobody can connect to; set --advertise-host to the host name or IP other machines "
        "reach this worker at"
    )
    silent = WorkerAddresses.bound("127.0.0.1", 8100, None, None)
    with pytest.raises(RegistrationRefusedError, match="--register-url needs the worker's"):
        body_of(silent)


def test_the_flags_and_their_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_WORKER_ADVERTISE_HOST", "worker-b")
    monkeypatch.setenv("KVROUTE_ROUTER_ADMIN_KEY", "s3cret")
    args = build_parser().parse_args(["--host", "0.0.0.0", "--register-url", "http://r:8000"])
    config = config_from_args(args)
    assert (config.host, config.advertise_host) == ("0.0.0.0", "worker-b")
    assert config.register_url == "http://r:8000"
    assert config.router_key is not None
    assert config.router_key.authorization == "Bearer s3cret"
    assert "s3cret" not in repr(config)
    args = build_parser().parse_args(["--advertise-host", "none", "--register-url", "none"])
    unset = config_from_args(args)
    assert (unset.advertise_host, unset.register_url) == (None, None)
    with pytest.raises(ValueError, match="expected the router's base URL"):
        WorkerConfig(register_url="router:8000")
    with pytest.raises(AddressError, match="is a wildcard"):
        WorkerConfig(advertise_host="0.0.0.0")
