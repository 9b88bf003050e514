"""The vLLM example (``deploy/vllm``): engines on their own machines, the router on another.

Each engine's ``--kv-events-config`` binds its event and replay sockets on every interface
(never loopback, which no other machine reaches), and publishes them with its HTTP port.
The router's workers, read from ``router.toml`` by the router's own config code, name a
host other than a wildcard or loopback, with the engine's ports, topic and block size,
and pass the router's policy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from events.auth import is_loopback, is_wildcard
from events.endpoints import tcp_port
from router.workers.registration import RegistrationPolicy
from tests.support.deploy import (
    DEPLOY,
    KvrouteCommand,
    key_files,
    published,
    router_config,
    shell_words,
    yaml_documents,
)

FOLDER = DEPLOY / "vllm"


def engine() -> tuple[list[str], dict[str, Any], dict[int, int]]:
    """The engine's ``vllm serve`` arguments, its events config and its published ports."""
    (doc,) = yaml_documents(FOLDER / "engine.compose.yaml")
    service = doc["services"]["vllm"]
    assert shell_words(service["entrypoint"]) == ["vllm", "serve"]
    argv = shell_words(service["command"])
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    return argv, events, published(service["ports"])


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_an_engine_binds_its_event_sockets_beyond_loopback_and_publishes_them() -> None:
    argv, events, ports = engine()
    assert events["enable_kv_cache_events"] is True
    assert events["publisher"] == "zmq"
    for name in ("endpoint", "replay_endpoint"):
        host = events[name].removeprefix("tcp://").rsplit(":", 1)[0]
        assert not is_loopback(host), events[name]
        assert tcp_port(events[name]) in ports
    assert int(value(argv, "--port")) in ports
    assert value(argv, "--host") == "0.0.0.0"


def test_the_router_names_each_engine_where_it_is_reached_with_its_ports(tmp_path: Path) -> None:
    argv, events, ports = engine()
    (doc,) = yaml_documents(FOLDER / "router.compose.yaml")
    command = KvrouteCommand.parse(shell_words(doc["services"]["router"]["command"]))
    files = key_files(["/run/secrets/admin_key", "/run/secrets/api_key"], tmp_path)
    files["/etc/kvroute/router.toml"] = FOLDER / "router.toml"
    config = router_config(command, files, "redis://:pw@redis:6379/0")
    policy = RegistrationPolicy.from_flags(config.allow_worker_nets)
    assert len(config.workers) == 2
    hosts = set()
    for record in config.workers:
        url = urlsplit(record.http_url)
        hosts.add(url.hostname)
        assert not (is_loopback(url.hostname or "") or is_wildcard(url.hostname or ""))
        assert record.events_endpoint == f"tcp://{url.hostname}:{tcp_port(events['endpoint'])}"
        assert record.replay_endpoint == (
            f"tcp://{url.hostname}:{tcp_port(events['replay_endpoint'])}"
        )
        assert url.port == int(value(argv, "--port"))
        assert {url.port, tcp_port(record.events_endpoint)} <= set(ports)
        assert record.topic == events["topic"]
        assert record.block_size == int(value(argv, "--block-size"))
        assert record.kind == "vllm"
        assert record.models == (value(argv, "--served-model-name"),)
        policy.check(record)
    assert len(hosts) == len(config.workers)  # one engine per machine, same ports
