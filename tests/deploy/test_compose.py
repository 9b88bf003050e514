"""The compose files (``deploy/compose.yaml``, ``deploy/vllm/router.compose.yaml``) still run.

Every kvroute service's command is parsed and turned into its config by kvroute's own
code, with its secrets and mounted files in place; its published ports and healthcheck
match its flags and a route its application serves. In the cluster file, each worker binds
every interface, advertises its service name and registers where the router listens, and
the record the router would build from that registration passes the router's own policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from router.workers.registration import RegistrationPolicy
from tests.support.deploy import (
    DEPLOY,
    KvrouteCommand,
    file_flags,
    interpolate,
    key_files,
    probe_url,
    published,
    registration_of,
    router_config,
    shell_words,
    yaml_documents,
)

COMPOSE_FILES = [DEPLOY / "compose.yaml", DEPLOY / "vllm" / "router.compose.yaml"]
ENV = {"REDIS_PASSWORD": "test-password"}


def services(path: Path) -> dict[str, dict[str, Any]]:
    (doc,) = yaml_documents(path)
    return dict(doc["services"])


def kvroute_services(path: Path) -> dict[str, KvrouteCommand]:
    """Service name -> its parsed kvroute command, for every service built from deploy/."""
    out = {}
    for name, service in services(path).items():
        if str(service.get("image", "")).startswith("kvroute-"):
            out[name] = KvrouteCommand.parse(shell_words(service["command"]))
    return out


def mounts(path: Path, name: str, command: KvrouteCommand, tmp: Path) -> dict[str, Path]:
    """The container paths a service's file flags name -> local files with their content.

    Secrets must be declared by the service and the file; bind mounts must exist.
    """
    (doc,) = yaml_documents(path)
    service = doc["services"][name]
    volumes = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        volumes[target] = path.parent / source
    secrets = []
    for value in file_flags(command):
        if value.startswith("/run/secrets/"):
            secret = value.removeprefix("/run/secrets/")
            assert secret in service["secrets"], f"{name} reads {value} without the secret"
            assert secret in doc["secrets"], f"secret {secret} is not declared"
            secrets.append(value)
        else:
            assert value in volumes, f"{name} reads {value}, which nothing mounts"
            assert volumes[value].is_file(), volumes[value]
    return {**key_files(secrets, tmp), **volumes}


def redis_url(service: dict[str, Any]) -> str:
    return interpolate(service["environment"]["KVROUTE_REDIS_URL"], ENV)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_each_kvroute_service_builds_its_config_and_listens_where_it_is_published_and_probed(
    path: Path, tmp_path: Path, app_routes: dict[str, set[tuple[str, str]]]
) -> None:
    all_services = services(path)
    commands = kvroute_services(path)
    assert commands
    for name, command in commands.items():
        service = all_services[name]
        build = service.get("build")
        if build is not None:
            assert (path.parent / build["context"] / build["dockerfile"]).is_file()
        files = mounts(path, name, command, tmp_path)
        if command.role == "router":
            config = router_config(command, files, redis_url(service))
            assert (config.host, config.port) == ("0.0.0.0", command.ports["http"])
            assert config.admin_key is not None and config.api_key is not None
        else:
            registration_of(command, files)  # the worker's config builds and registers
        assert set(published(service.get("ports", []))) <= set(command.ports.values())
        port, probe = probe_url(service["healthcheck"]["test"])
        assert port == command.ports["http"], name
        assert ("GET", probe) in app_routes[command.role], f"{name} probes {probe}"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_the_router_reaches_redis_with_its_password(path: Path) -> None:
    all_services = services(path)
    redis = shell_words(all_services["redis"]["command"])
    password = interpolate(redis[redis.index("--requirepass") + 1], ENV)
    for name in kvroute_services(path):
        if "KVROUTE_REDIS_URL" in all_services[name].get("environment", {}):
            url = urlsplit(redis_url(all_services[name]))
            assert (url.hostname, url.port) == ("redis", int(redis[redis.index("--port") + 1]))
            assert url.password == password == ENV["REDIS_PASSWORD"]


def test_workers_bind_everywhere_advertise_their_name_and_the_router_admits_them(
    tmp_path: Path,
) -> None:
    path = DEPLOY / "compose.yaml"
    all_services = services(path)
    commands = kvroute_services(path)
    routers = {n: c for n, c in commands.items() if c.role == "router"}
    workers = {n: c for n, c in commands.items() if c.role == "worker"}
    assert len(routers) == 1 and len(workers) == 2
    ((router_name, router),) = routers.items()
    config = router_config(
        router, mounts(path, router_name, router, tmp_path), redis_url(all_services[router_name])
    )
    policy = RegistrationPolicy.from_flags(
        config.allow_worker_nets, own_address=(config.host, config.port)
    )
    backend = set(all_services["redis"]["networks"])
    for name, worker in workers.items():
        assert worker.args.host == "0.0.0.0"
        assert worker.args.advertise_host == name
        target = urlsplit(worker.args.register_url)
        assert (target.hostname, target.port) == (router_name, router.ports["http"])
        record = registration_of(worker, mounts(path, name, worker, tmp_path))
        assert record.worker_id == worker.args.worker_id == name
        assert urlsplit(record.http_url).hostname == name
        policy.check(record)
        # Only the router shares the workers' network, and only the router is published.
        assert set(all_services[name]["networks"]) == backend
        assert "ports" not in all_services[name]
    (doc,) = yaml_documents(path)
    assert all(doc["networks"][n].get("internal") is True for n in backend)
    assert backend <= set(all_services[router_name]["networks"])
