"""Reading the files under ``deploy/`` as kvroute itself would meet them.

Each kvroute command line found in an image, compose file or manifest is parsed by the real
parsers (:func:`router.cli.router_flags.build_parser`, :func:`pool.worker.flags.build_parser`) and
turned into the real configs, with the files the container would see mounted (secrets,
config maps) mapped onto local copies. Routes are read from the real applications. Nothing
here knows a flag of its own: ports, hosts and paths all come from those parsers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import yaml
from aiohttp import web

from events.endpoints import tcp_port
from tests.support.paths import REPO_ROOT

DEPLOY: Final = REPO_ROOT / "deploy"
TEST_KEY: Final = "0123456789abcdef0123456789abcdef"
"""What every mounted key file holds in the tests (the real ones are the operator's)."""


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Every document of a YAML file (empty ones dropped)."""
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def exec_form(arguments: str) -> list[str]:
    """An instruction's exec form (``["a", "b"]``); anything else fails the test."""
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


@dataclass(frozen=True)
class KvrouteCommand:
    """One ``kvroute ROLE ...`` command line, parsed by kvroute's own parser.

    Attributes:
        role: ``router`` or ``worker``.
        argv: The arguments after the role, as written.
        args: What the role's parser made of them.
    """

    role: str
    argv: tuple[str, ...]
    args: argparse.Namespace

    @classmethod
    def parse(cls, argv: Sequence[str]) -> KvrouteCommand:
        """Parse ``[ROLE, *flags]`` (a container's command after the ``kvroute`` entry point).

        Raises:
            SystemExit: The parser refused it (argparse's way), which fails the test.
        """
        role, *rest = argv
        return cls(role, tuple(rest), parser(role).parse_args(rest))

    @property
    def ports(self) -> dict[str, int]:
        """What this command listens on: ``http`` and, for a worker, ``events``/``replay``."""
        ports = {"http": int(self.args.port)}
        if self.role == "worker":
            for name in ("events", "replay"):
                address = getattr(self.args, name)
                port = tcp_port(address) if address not in (None, "", "none") else None
                if port is not None:
                    ports[name] = port
        return ports

    def with_files(self, mounts: Mapping[str, Path]) -> list[str]:
        """The arguments with every mounted path replaced by its local copy."""
        return [str(mounts.get(a, a)) for a in self.argv]


def parser(role: str) -> argparse.ArgumentParser:
    """The real parser of ``kvroute ROLE``."""
    if role == "router":
        from router.cli.router_flags import build_parser

        return build_parser()
    assert role == "worker", f"not a kvroute role of deploy/: {role!r}"
    from pool.worker.flags import build_parser as build_worker_parser

    return build_worker_parser()


def key_files(paths: Sequence[str], tmp: Path) -> dict[str, Path]:
    """Each container path of a key file -> a local file holding :data:`TEST_KEY`."""
    out = {}
    for i, path in enumerate(paths):
        local = tmp / f"key-{i}"
        local.write_text(TEST_KEY + "\n")
        out[path] = local
    return out


def file_flags(command: KvrouteCommand) -> list[str]:
    """The values of every ``--*-file`` and ``--config`` flag of a command."""
    out = []
    for flag, value in itertools.pairwise(command.argv):
        if flag.endswith("-file") or flag == "--config":
            out.append(value)
    return out


def routes(app: web.Application) -> set[tuple[str, str]]:
    """``(method, path)`` of every route an application serves."""
    return {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None
    }


def probe_url(test: Sequence[str]) -> tuple[int, str]:
    """``(port, path)`` of the one ``http://`` URL in a compose healthcheck command."""
    urls = re.findall(r"http://[^'\"\s]+", " ".join(test))
    assert len(urls) == 1, test
    parts = urlsplit(urls[0])
    assert parts.hostname == "127.0.0.1" and parts.port is not None, urls[0]
    return parts.port, parts.path


def published(ports: Sequence[str]) -> dict[int, int]:
    """Compose ``"HOST:CONTAINER"`` mappings as container port -> host port."""
    out = {}
    for mapping in ports:
        host, _, container = str(mapping).rpartition(":")
        out[int(container)] = int(host or container)
    return out


def expand(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of container args."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in argv]


def shell_words(command: str | Sequence[str]) -> list[str]:
    """A compose ``command``/``entrypoint`` as a list (a string is split as a shell does)."""
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def manifests(folder: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """``(file, document)`` of every Kubernetes object in a folder's YAML files."""
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml_documents(path):
            if "apiVersion" in doc and "kind" in doc and doc["kind"] != "Kustomization":
                yield path, doc


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's ``${NAME}``, ``${NAME:?message}`` and ``${NAME:-default}`` with ``env``."""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::[?-][^}]*)?\}", lambda m: env[m.group(1)], text)


def registration_of(worker: KvrouteCommand, mounts: Mapping[str, Path]) -> Any:
    """The ``WorkerRecord`` a worker command registers, as the router would build it.

    The worker's own config (:func:`pool.worker.config.config_from_args`) gives the addresses
    it announces before binding (its ports are fixed in ``deploy/``), the body is the one
    it sends, and the record is built the way the router's ``PUT /v1/workers/ID`` builds it.
    """
    from pool.worker.addresses import WorkerAddresses
    from pool.worker.config import config_from_args
    from pool.worker.router_registration import registration_body
    from router.workers.registry import WorkerRecord

    args = parser("worker").parse_args(worker.with_files(mounts))
    config = config_from_args(args)
    bound = WorkerAddresses.bound(config.host, config.port, config.events, config.replay)
    body = registration_body(
        config.worker_id,
        bound.advertised(config.advertise_host),
        topic=config.topic,
        block_size=config.block_size,
        models=config.model_names,
        server_key=None,
    )
    return WorkerRecord(
        worker_id=body["worker_id"],
        events_endpoint=body["events"],
        replay_endpoint=body["replay"],
        http_url=body["url"],
        block_size=body["block_size"],
        topic=body["topic"],
        served_models=tuple(body["models"]),
    )


def router_config(router: KvrouteCommand, mounts: Mapping[str, Path], redis_url: str) -> Any:
    """The ``RouterConfig`` a router command builds
    (:func:`router.cli.router_config.config_from_args`)."""
    from router.cli.router_config import config_from_args

    return config_from_args(parser("router").parse_args(router.with_files(mounts)), redis_url)
