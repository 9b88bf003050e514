"""Turn the parsed flags of ``kvroute router`` into a validated :class:`RouterConfig`.

The flags come from :func:`router.cli.router_flags.build_parser`; the order in which
defaults, the config file, the environment and the flags override each other is that of
:mod:`router.cli.router`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

import msgspec

from events.auth import (
    ADMIN_KEY,
    API_KEY,
    WORKER_ADMIN_KEY,
    WORKER_API_KEY,
    AuthKeyError,
    load_key,
    load_sent_key,
)
from events.cli.liveness import liveness_from
from events.curve import CurveKeyError, CurveKeyPair, load_public_key
from router.cli.cost_flags import cost_weights_from
from router.cli.router_flags import (
    DEFAULT_ACCURACY,
    DEFAULT_BREAKER,
    DEFAULT_LIMITS,
    DEFAULT_PROXY,
    DEFAULT_SESSIONS,
    DEFAULT_TOKENIZERS,
    RENAMED,
    WORKER_USAGE,
    build_parser,
)
from router.errors import PrefixIndexError, RouterError
from router.front.accuracy import AccuracyConfig
from router.front.breaker import BreakerConfig
from router.front.config import RequestLimits, RouterConfig
from router.front.engine_tokenizer import DEFAULT_CACHE_TOKENS
from router.front.proxy_contracts import ProxyConfig
from router.front.tokenization import TokenizerSources
from router.front.tracing import wants_tracing
from router.routing.policies import DEFAULT_POLICY, PolicyConfig
from router.routing.sessions import SessionConfig
from router.store.layout import check_name
from router.workers.registration import RegistrationError, RegistrationPolicy
from router.workers.registry import WorkerRecord

__all__ = [
    "RouterCliError",
    "config_from_args",
    "load_config_file",
    "parse_worker_flag",
]


class RouterCliError(RouterError, ValueError):
    """A flag or the config file is invalid."""


def parse_worker_flag(spec: str) -> WorkerRecord:
    """Parse one ``--worker`` value (see :data:`WORKER_USAGE`).

    Raises:
        RouterCliError: The value is malformed; the message shows the expected shape.
    """
    head, *options = spec.split(",")
    worker_id, sep, url = head.partition("=")
    if not sep or not worker_id or not url.startswith(("http://", "https://")):
        raise RouterCliError(f"--worker {spec!r}: expected {WORKER_USAGE}")
    fields: dict[str, Any] = {"worker_id": worker_id, "http_url": url}
    names = {"events": "events_endpoint", "replay": "replay_endpoint", "topic": "topic",
             "block-size": "block_size", "block_size": "block_size", "kind": "kind",
             "server_key": "server_key"}  # fmt: skip
    models: list[str] = []
    for option in options:
        name, sep, value = option.partition("=")
        if sep and name == "model":  # repeatable: one per model the worker serves
            models.append(value)
            continue
        if not sep or name not in names:
            raise RouterCliError(
                f"--worker {spec!r}: bad option {option!r}; expected {WORKER_USAGE}"
            )
        fields[names[name]] = value
    if models:
        fields["models"] = models
    if "events_endpoint" not in fields:
        raise RouterCliError(
            f"--worker {spec!r}: events=ENDPOINT is required; expected {WORKER_USAGE}"
        )
    if "server_key" in fields:
        try:
            fields["server_key"] = load_public_key(fields["server_key"]).decode()
        except CurveKeyError as exc:
            raise RouterCliError(f"--worker {spec!r}: server_key: {exc}") from exc
    return _record(fields, f"--worker {spec!r}")


def _record(fields: dict[str, Any], where: str) -> WorkerRecord:
    try:
        # Not strict: a flag's block size is text.
        return msgspec.convert(fields, WorkerRecord, strict=False)
    except msgspec.ValidationError as exc:
        raise RouterCliError(f"{where}: {exc}") from exc


def _config_workers(items: Any) -> list[WorkerRecord]:
    """Workers of a config file: flag strings or tables like ``POST /v1/workers`` bodies."""
    if not isinstance(items, list):
        raise RouterCliError("config 'workers' must be a list")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(parse_worker_flag(item))
        elif isinstance(item, dict):
            renamed = {"url": "http_url", "events": "events_endpoint", "replay": "replay_endpoint"}
            fields = {renamed.get(str(k), str(k)): v for k, v in item.items()}
            out.append(_record(fields, f"config worker {item}"))
        else:
            raise RouterCliError(f"config worker {item!r} must be a string or a table")
    return out


def load_config_file(path: str) -> dict[str, Any]:
    """Read a TOML (``.toml``) or JSON config file into a dict of flag-named settings.

    Raises:
        RouterCliError: The file cannot be read or parsed, or is not a table.
    """
    try:
        text = Path(path).read_text()
        data = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
    except (OSError, ValueError) as exc:
        raise RouterCliError(f"--config {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise RouterCliError(f"--config {path!r}: expected a table of settings")
    return data


def config_from_args(args: argparse.Namespace, redis_url: str) -> RouterConfig:
    """Merge defaults, the config file, the environment and flags into a :class:`RouterConfig`.

    Raises:
        RouterCliError: A setting is invalid.
    """
    file = load_config_file(args.config) if args.config else {}
    file = {RENAMED.get(key, key): value for key, value in file.items()}
    known = {a.dest for a in build_parser()._actions} | {"workers"}
    unknown = sorted(set(file) - known)
    if unknown:
        raise RouterCliError(f"--config {args.config!r}: unknown settings {', '.join(unknown)}")

    def pick(name: str, default: Any, env: str | None = None) -> Any:
        flag = getattr(args, name, None)
        if flag is not None:
            return flag
        if env is not None and os.environ.get(env):
            return os.environ[env]
        return file.get(name, default)

    try:
        weights = cost_weights_from(pick)
        policy_config = PolicyConfig(
            weights=weights,
            seed=pick("seed", 0),
            predicted_ttl_s=pick("predicted_ttl_s", PolicyConfig().predicted_ttl_s),
        )
        limits = RequestLimits(
            max_body_bytes=pick("max_body_bytes", DEFAULT_LIMITS.max_body_bytes),
            max_prompt_tokens=pick("max_prompt_tokens", DEFAULT_LIMITS.max_prompt_tokens),
            body_read_timeout_s=_positive(
                "body_read_timeout_s",
                pick("body_read_timeout_s", DEFAULT_LIMITS.body_read_timeout_s),
            ),
        )
        proxy = ProxyConfig(
            connect_timeout_s=float(
                pick("proxy_connect_timeout_s", DEFAULT_PROXY.connect_timeout_s)
            ),
            first_byte_timeout_s=float(
                pick("proxy_first_byte_timeout_s", DEFAULT_PROXY.first_byte_timeout_s)
            ),
            total_timeout_s=float(pick("proxy_total_timeout_s", DEFAULT_PROXY.total_timeout_s)),
            max_attempts=int(pick("max_attempts", DEFAULT_PROXY.max_attempts)),
            forward_authorization=bool(pick("forward_authorization", False)),
        )
        breaker = BreakerConfig(
            failure_threshold=int(pick("circuit_failures", DEFAULT_BREAKER.failure_threshold)),
            cooldown_s=float(pick("circuit_cooldown_s", DEFAULT_BREAKER.cooldown_s)),
        )
        accuracy = AccuracyConfig(
            window_requests=int(pick("accuracy_window_requests", DEFAULT_ACCURACY.window_requests)),
            warn_below_ratio=float(
                pick("accuracy_warn_below_ratio", DEFAULT_ACCURACY.warn_below_ratio)
            ),
            min_tokens=int(pick("accuracy_min_tokens", DEFAULT_ACCURACY.min_tokens)),
            warn_interval_s=float(
                pick("accuracy_warn_interval_s", DEFAULT_ACCURACY.warn_interval_s)
            ),
        )
        sessions = SessionConfig(
            bonus_tokens=int(pick("session_affinity_tokens", DEFAULT_SESSIONS.bonus_tokens)),
            ttl_s=float(pick("session_ttl_s", DEFAULT_SESSIONS.ttl_s)),
            max_entries=int(pick("session_max_entries", DEFAULT_SESSIONS.max_entries)),
        )
        event_liveness = liveness_from(pick)
        event_idle_check_s = float(pick("event_idle_check_s", RouterConfig.event_idle_check_s))
        if event_idle_check_s < 0:
            raise ValueError(f"--event-idle-check-s must be >= 0, got {event_idle_check_s:g}")
        tokenizers = TokenizerSources.from_flags(
            _strings(pick("tokenizer", None)),
            _strings(pick("tokenize_via_engine", None)),
            chat_template=pick("chat_template", None),
            cache_tokens=int(pick("tokenize_cache_tokens", DEFAULT_CACHE_TOKENS)),
            timeout_s=float(pick("tokenize_timeout_s", DEFAULT_TOKENIZERS.timeout_s)),
        )
    except (TypeError, ValueError, RouterError) as exc:
        raise RouterCliError(f"invalid setting: {exc}") from exc
    workers = _config_workers(file.get("workers", [])) + [parse_worker_flag(s) for s in args.worker]
    client_key = pick("client_key", None, "KVROUTE_CLIENT_KEY")
    require_curve = bool(pick("require_curve", False))
    if require_curve and client_key is None:
        raise RouterCliError(
            "--require-curve needs --client-key: the router's CURVE secret key file, whose "
            "public key the workers allow (`kvroute keys` writes both)"
        )
    allowed = tuple(str(net) for net in pick("allow_worker_net", None) or ())
    try:
        RegistrationPolicy.from_flags(allowed)
        admin_key, api_key = (
            load_key(spec, pick(spec.dest, None), pick(spec.file_dest, None))
            for spec in (ADMIN_KEY, API_KEY)
        )
        worker_api_key, worker_admin_key = (
            load_sent_key(spec, pick(spec.dest, None), pick(spec.file_dest, None))
            for spec in (WORKER_API_KEY, WORKER_ADMIN_KEY)
        )
    except (RegistrationError, AuthKeyError) as exc:
        raise RouterCliError(str(exc)) from None
    return RouterConfig(
        redis_url=redis_url,
        namespace=pick("namespace", "default", "KVROUTE_NAMESPACE"),
        host=pick("host", "127.0.0.1"),
        port=pick("port", 8000),
        workers=tuple(workers),
        policy=pick("policy", DEFAULT_POLICY),
        policy_config=policy_config,
        tokenizers=tokenizers,
        decision_log=pick("decision_log", None),
        limits=limits,
        proxy=dataclasses.replace(proxy, worker_key=worker_api_key),
        breaker=breaker,
        lease_ttl_s=float(pick("lease_ttl_s", 10.0)),
        predicted_max_entries=int(
            pick("predicted_max_entries", RouterConfig.predicted_max_entries)
        ),
        route_hold_s=float(pick("route_hold_s", 2.0)),
        replay_timeout_s=float(pick("replay_timeout_s", RouterConfig.replay_timeout_s)),
        replay_deadline_s=float(pick("replay_deadline_s", RouterConfig.replay_deadline_s)),
        event_liveness=event_liveness,
        event_idle_check_s=event_idle_check_s,
        client_keys=_client_keys(client_key),
        replica_id=_replica_id(pick("replica_id", None, "KVROUTE_REPLICA_ID")),
        admin_key=admin_key,
        api_key=api_key,
        worker_admin_key=worker_admin_key,
        allow_worker_nets=allowed,
        require_curve=require_curve,
        accuracy=accuracy,
        sessions=sessions,
        otel=wants_tracing(bool(pick("otel", False)), os.environ),
        otel_required=bool(pick("otel", False)),
    )


def _strings(value: Any) -> list[str]:
    """A repeatable setting as a list: flags give a list, a config file a string, a list,
    or ``true`` (a bare flag, as ``--tokenize-via-engine`` alone)."""
    if value is None or value is False:
        return []
    if value is True:
        return [""]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"expected a string or a list of strings, got {value!r}")


def _positive(name: str, value: Any) -> float:
    """``value`` as a number of seconds above 0."""
    seconds = float(value)
    if not seconds > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return seconds


def _replica_id(value: str | None) -> str | None:
    """A valid ``--replica-id`` (it appears in key names and lease tokens), or None."""
    if value is None:
        return None
    try:
        return check_name("--replica-id", str(value))
    except PrefixIndexError as exc:
        raise RouterCliError(str(exc)) from None


def _client_keys(path: str | None) -> CurveKeyPair:
    """The router's CURVE key pair: loaded from ``--client-key``, else a fresh one."""
    return CurveKeyPair.load(path) if path else CurveKeyPair.generate()
