"""The Kubernetes manifests (``deploy/kubernetes``) still match what kvroute does.

Each container's args (``$(VAR)`` expanded per replica) are parsed and turned into configs
by kvroute's own code, with the ConfigMap and Secret files mounted where the pod sees them.
Probes name routes the application serves, on the port its flags listen on; container
ports, Services and NetworkPolicies name those same ports. Every worker replica's
registration passes the routers' policy, and registrations reach routers that are not
ready yet (a router is ready only once a worker registered).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from events.auth import ADMIN_KEY, AuthKeyError, load_key
from router.workers.registration import RegistrationPolicy
from tests.support.deploy import (
    DEPLOY,
    KvrouteCommand,
    expand,
    key_files,
    manifests,
    registration_of,
    router_config,
    yaml_documents,
)

FOLDER = DEPLOY / "kubernetes"
OBJECTS = [doc for _, doc in manifests(FOLDER)]
WORKLOADS = [d for d in OBJECTS if d["kind"] in ("Deployment", "StatefulSet")]


def named(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in OBJECTS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return dict(only)


def pod_names(workload: dict[str, Any]) -> list[str]:
    """The pod names of a workload: ``NAME-N`` for a StatefulSet, one sample otherwise."""
    name = workload["metadata"]["name"]
    if workload["kind"] == "StatefulSet":
        return [f"{name}-{i}" for i in range(workload["spec"]["replicas"])]
    return [f"{name}-7d9f8-abcde"]


def commands(workload: dict[str, Any]) -> list[KvrouteCommand]:
    """The kvroute command of each pod of a workload (its ``fieldRef`` env expanded)."""
    spec = container(workload)
    out = []
    for pod in pod_names(workload):
        env = {
            e["name"]: pod
            for e in spec.get("env", [])
            if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name"
        }
        out.append(KvrouteCommand.parse(expand(spec["args"], env)))
    return out


def mounted_files(workload: dict[str, Any], tmp: Path) -> dict[str, Path]:
    """Every file a pod sees under its ConfigMap and Secret volumes -> a local copy.

    ConfigMap files hold the map's data; Secret files hold a test key (the real ones are
    created by the operator), and each must be a key of the Secret manifest.
    """
    spec = container(workload)
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    secrets, files = [], {}
    for mount in spec.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            data = named("ConfigMap", volume["configMap"]["name"])["data"]
            for key, text in data.items():
                local = tmp / f"{mount['name']}-{key}"
                local.write_text(text)
                files[f"{mount['mountPath']}/{key}"] = local
        else:
            secret = named("Secret", volume["secret"]["secretName"])
            for item in volume["secret"]["items"]:
                assert item["key"] in secret["stringData"], item
                secrets.append(f"{mount['mountPath']}/{item['path']}")
    return {**files, **key_files(secrets, tmp)}


def container_ports(workload: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(workload)["ports"]}


def probe_port(workload: dict[str, Any], port: int | str) -> int:
    return container_ports(workload)[port] if isinstance(port, str) else port


def redis_url_of(workload: dict[str, Any]) -> str:
    env = {e["name"]: e for e in container(workload)["env"]}
    return expand([env["KVROUTE_REDIS_URL"]["value"]], {"REDIS_PASSWORD": "pw"})[0]


def selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def test_kustomization_lists_every_manifest() -> None:
    (kustomization,) = yaml_documents(FOLDER / "kustomization.yaml")
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in FOLDER.glob("*.yaml")} - {"kustomization.yaml"}


def test_the_secret_placeholders_are_refused_so_nothing_starts_with_them() -> None:
    secret = named("Secret", "kvroute-keys")
    for key in ("admin_key", "api_key"):
        with pytest.raises(AuthKeyError, match="has characters a bearer token cannot carry"):
            load_key(ADMIN_KEY, secret["stringData"][key], None)


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w["metadata"]["name"])
def test_probes_and_container_ports_match_the_flags_and_the_routes(
    workload: dict[str, Any], app_routes: dict[str, set[tuple[str, str]]]
) -> None:
    spec = container(workload)
    if spec["image"].startswith("redis"):
        assert set(container_ports(workload).values()) == {int(spec["args"][1])}
        return
    for command in commands(workload):
        assert set(container_ports(workload).values()) == set(command.ports.values())
        for kind in ("livenessProbe", "readinessProbe"):
            probe = spec[kind]["httpGet"]
            assert probe_port(workload, probe["port"]) == command.ports["http"], kind
            assert ("GET", probe["path"]) in app_routes[command.role], probe
    selector = workload["spec"]["selector"]["matchLabels"]
    assert selects(selector, workload)


def test_services_and_network_policies_name_ports_their_pods_open() -> None:
    for doc in OBJECTS:
        if doc["kind"] == "Service":
            pods = [w for w in WORKLOADS if selects(doc["spec"]["selector"], w)]
            assert pods, doc["metadata"]["name"]
            for port in doc["spec"]["ports"]:
                assert all(port["targetPort"] in container_ports(w) for w in pods), port
                assert all(container_ports(w)[port["targetPort"]] == port["port"] for w in pods)
        if doc["kind"] == "NetworkPolicy":
            pods = [w for w in WORKLOADS if selects(doc["spec"]["podSelector"]["matchLabels"], w)]
            assert pods, doc["metadata"]["name"]
            opened = {p["port"] for rule in doc["spec"]["ingress"] for p in rule["ports"]}
            assert all(opened == set(container_ports(w).values()) for w in pods)


def test_every_replica_builds_its_config_and_every_worker_is_admitted(tmp_path: Path) -> None:
    router = named("Deployment", "kvroute-router")
    workers = named("StatefulSet", "kvroute-worker")
    (router_command,) = commands(router)
    config = router_config(router_command, mounted_files(router, tmp_path), redis_url_of(router))
    assert config.admin_key is not None and config.api_key is not None
    policy = RegistrationPolicy.from_flags(
        config.allow_worker_nets, own_address=(config.host, config.port)
    )
    redis = urlsplit(redis_url_of(router))
    redis_service = named("Service", redis.hostname or "")
    assert [p["port"] for p in redis_service["spec"]["ports"]] == [redis.port]
    worker_files = mounted_files(workers, tmp_path)
    for pod, command in zip(pod_names(workers), commands(workers), strict=True):
        assert command.args.host == "0.0.0.0"
        assert command.args.worker_id == pod
        # The advertised name is the pod's own DNS name under the StatefulSet's service.
        service = named("Service", workers["spec"]["serviceName"])
        assert command.args.advertise_host == f"{pod}.{service['metadata']['name']}"
        assert service["spec"]["clusterIP"] == "None"
        policy.check(registration_of(command, worker_files))


def test_registrations_reach_routers_that_are_not_ready_yet() -> None:
    router = named("Deployment", "kvroute-router")
    assert container(router)["readinessProbe"]["httpGet"]["path"] == "/ready"
    for command in commands(named("StatefulSet", "kvroute-worker")):
        target = urlsplit(command.args.register_url)
        service = named("Service", target.hostname or "")
        assert selects(service["spec"]["selector"], router)
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True
        assert [p["port"] for p in service["spec"]["ports"]] == [target.port]

