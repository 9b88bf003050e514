"""``kvroute router``: run one cache-aware router replica from flags and an optional config file.

Settings come from, in increasing priority: defaults, ``--config FILE`` (TOML or JSON,
keys named like the flags with underscores), environment variables ``KVROUTE_REDIS_URL``
and ``KVROUTE_NAMESPACE``, then the flags. Without ``--redis`` an embedded Redis is
started on a free loopback port and stopped on exit. Once serving, one JSON line
``{"router": URL, "redis": URL, "replica_id": ID}`` is printed on stdout; logs go to
stderr. SIGTERM or SIGINT stop the router cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

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
    add_key_arguments,
    load_key,
    load_sent_key,
)
from events.cli.flags import add_flag, renamed_dests
from events.cli.liveness import DEFAULTS as LIVENESS_DEFAULTS
from events.cli.liveness import LIVENESS_HELP, liveness_from
from events.curve import CurveKeyError, CurveKeyPair, load_public_key
from events.errors import EventsError
from events.hashing import NATIVE_KEYS
from events.schema import NATIVE_DECODE
from router.cli.cost_flags import add_cost_arguments, cost_weights_from
from router.cli.event_loop import EVENT_LOOPS, run_on
from router.errors import PrefixIndexError, RouterError
from router.front.access import exposure_warning
from router.front.accuracy import AccuracyConfig
from router.front.app import guards
from router.front.breaker import BreakerConfig
from router.front.config import RequestLimits, RouterConfig
from router.front.engine_tokenizer import DEFAULT_CACHE_TOKENS
from router.front.proxy_contracts import ProxyConfig
from router.front.service import RouterService
from router.front.tokenization import TokenizerSources
from router.front.tracing import wants_tracing
from router.ingest._native.runs import NATIVE_RUNS
from router.routing.policies import DEFAULT_POLICY, POLICY_NAMES, PolicyConfig
from router.routing.sessions import SessionConfig
from router.store.connection import redact_url
from router.store.layout import check_name
from router.store.server import RedisServer
from router.workers.registration import RegistrationError, RegistrationPolicy
from router.workers.registry import WorkerRecord

__all__ = ["build_parser", "config_from_args", "main", "parse_worker_flag"]

logger = logging.getLogger(__name__)

_WORKER_USAGE = (
    "ID=HTTP_URL,events=ENDPOINT[,replay=ENDPOINT][,topic=T][,block-size=N][,kind=vllm]"
    "[,model=NAME]...[,server_key=FILE]"
)

# Defaults of the settings (slotted dataclasses keep them on instances only).
_PROXY = ProxyConfig()
_BREAKER = BreakerConfig()
_LIMITS = RequestLimits()
_ACCURACY = AccuracyConfig()
_SESSIONS = SessionConfig()
_TOKENIZERS = TokenizerSources()


class RouterCliError(RouterError, ValueError):
    """A flag or the config file is invalid."""


def parse_worker_flag(spec: str) -> WorkerRecord:
    """Parse one ``--worker`` value (see :data:`_WORKER_USAGE`).

    Raises:
        RouterCliError: The value is malformed; the message shows the expected shape.
    """
    head, *options = spec.split(",")
    worker_id, sep, url = head.partition("=")
    if not sep or not worker_id or not url.startswith(("http://", "https://")):
        raise RouterCliError(f"--worker {spec!r}: expected {_WORKER_USAGE}")
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
                f"--worker {spec!r}: bad option {option!r}; expected {_WORKER_USAGE}"
            )
        fields[names[name]] = value
    if models:
        fields["models"] = models
    if "events_endpoint" not in fields:
        raise RouterCliError(
            f"--worker {spec!r}: events=ENDPOINT is required; expected {_WORKER_USAGE}"
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


def _flags() -> list[tuple[str, Callable[[str], Any], str]]:
    """``(flag, type, help)`` of every single-valued flag; help states the default."""
    return [
        ("--redis", str, "Redis URL (redis://, rediss:// for TLS, password in the URL); default: "
         "$KVROUTE_REDIS_URL, else an embedded redis-server on loopback"),
        ("--namespace", str, "key namespace shared by the replicas of one cluster (default: "
         "$KVROUTE_NAMESPACE, else 'default')"),
        ("--host", str, "address to listen on (default: 127.0.0.1, loopback only)"),
        ("--port", int, "port to listen on; 0 picks a free one (default: 8000)"),
        ("--config", str, "TOML or JSON file with any of these settings (keys with underscores; "
         "'workers' a list of --worker specs or POST /v1/workers tables); flags override it"),
        ("--predicted-ttl-s", float, "seconds a routed prefix is credited to its worker before "
         f"its events confirm it (default: {PolicyConfig().predicted_ttl_s})"),
        ("--predicted-max-entries", int, "most (prefix block, worker) credits the predicted "
         "entries keep, up to ~350 bytes each; past it the oldest are forgotten early "
         f"(default: {RouterConfig.predicted_max_entries})"),
        ("--seed", int, "seed of the sampling policies (default: 0)"),
        ("--decision-log", str, "append one JSON line per routing decision to this file "
         "(read by kvroute explain)"),
        ("--chat-template", str, "file whose chat template renders chat requests for every "
         "local --tokenizer: a tokenizer_config.json or a Jinja2 file (default: the "
         "tokenizer directory's own, else the built-in <|role|> template of kvroute workers)"),
        ("--tokenize-cache-tokens", int, "token ids the cache of the engines' POST /tokenize "
         f"answers holds, 4 bytes each (default: {DEFAULT_CACHE_TOKENS})"),
        ("--tokenize-timeout-s", float, "seconds to wait for one worker's POST /tokenize "
         f"answer before asking the next (default: {_TOKENIZERS.timeout_s:g})"),
        ("--max-body-bytes", int, "largest request body accepted (default: 4194304)"),
        ("--max-prompt-tokens", int, "longest prompt accepted, in tokens (default: 131072)"),
        ("--lease-ttl-s", float, "seconds of a worker's index lease; a dead worker or router is "
         "dropped after it (default: 10)"),
        ("--replay-timeout-s", float, "seconds of silence accepted from a worker's replay "
         f"endpoint (default: {RouterConfig.replay_timeout_s:g})"),
        ("--replay-deadline-s", float, "seconds a whole replay may take, however steadily its "
         "replies come; past it or the timeout the worker is resynced (default: "
         f"{RouterConfig.replay_deadline_s:g})"),
        *((f"--{dest.replace('_', '-')}", float,
           f"{meaning} (default: {LIVENESS_DEFAULTS[dest]:g})")
          for dest, meaning in LIVENESS_HELP.items()),
        ("--event-idle-check-s", float, "seconds a worker's event stream may stay quiet before "
         "its position is checked against its publisher's (a kvroute worker's next seq in "
         "GET /health; a replay from the last seq seen for others): missed batches are "
         "replayed or the worker resynced, and the connection made again; 0 turns it off "
         f"(default: {RouterConfig.event_idle_check_s:g})"),
        ("--route-hold-s", float, "seconds a POST /v1/route decision counts as load on its worker "
         "(the gateway sends the request itself; default: 2)"),
        ("--max-attempts", int, "workers a request is tried on at most, the chosen one "
         f"included (default: {_PROXY.max_attempts}); only a worker that sent no answer "
         "is retried (refused, dropped or silent before its first byte, or a 503 saying it "
         "is draining or overloaded), never after a 4xx/5xx answer or once the client got a "
         "byte"),
        ("--proxy-connect-timeout-s", float, "seconds to connect to a worker, and for a silent "
         "worker to answer the GET /health liveness probe; past it the next worker is tried "
         f"(default: {_PROXY.connect_timeout_s:g})"),
        ("--proxy-first-byte-timeout-s", float, "seconds a worker may stay silent (before its "
         "first byte, or mid-answer) before it is probed with GET /health; if that gets no "
         "answer the worker is given up, with every request to it silent since the probe "
         "began, and each is retried elsewhere if it got no byte yet. A long prompt's "
         "prefill comes before the first byte, and a non-streamed answer comes whole after "
         "its completion, so a worker that answers the probe is waited on: this bounds "
         "failover from a frozen or cut-off worker (in about this + the connect timeout; "
         "sooner when the worker's health poll goes unanswered, which probes at once), "
         "not the length of a request; a busy worker costs one probe per this much silence "
         f"(default: {_PROXY.first_byte_timeout_s:g})"),
        ("--proxy-total-timeout-s", float, "seconds one proxied request may take, every "
         "attempt and the whole stream included; past it the request is ended (504 if "
         f"nothing was sent yet; default: {_PROXY.total_timeout_s:g})"),
        ("--body-read-timeout-s", float, "seconds a client may take to send its request body "
         f"(408 after it; default: {_LIMITS.body_read_timeout_s:g})"),
        ("--circuit-failures", int, "consecutive failures (connect errors, timeouts, 5xx) that "
         "open a worker's circuit, keeping it out of routing; one failure that shows the "
         "worker unreachable opens it at once "
         f"(default: {_BREAKER.failure_threshold})"),
        ("--circuit-cooldown-s", float, "seconds an open circuit keeps a worker out of routing "
         "before one trial request is let through (closed again on its success; default: "
         f"{_BREAKER.cooldown_s:g})"),
        ("--replica-id", str, "this replica's id, naming its leases, heartbeat and shared "
         "load in Redis and metrics ([A-Za-z0-9_.:@-]; default: $KVROUTE_REPLICA_ID, else a "
         "random one)"),
        ("--session-affinity-tokens", int, "prompt tokens the worker that served a request's "
         "session last (X-Session-Id header, else the body's user field) is credited with, "
         "as if cached; 0 turns session affinity off. The default is worth half a request "
         "in flight at the default weights: it wins ties and loses to any worker with one "
         "request less in flight "
         f"(default: {_SESSIONS.bonus_tokens})"),
        ("--session-ttl-s", float, "seconds a session is remembered after its last request "
         f"(default: {_SESSIONS.ttl_s:g})"),
        ("--session-max-entries", int, "most sessions remembered; past it the least recently "
         f"seen are forgotten (default: {_SESSIONS.max_entries})"),
        ("--accuracy-window-requests", int, "requests per worker over which routing accuracy "
         "(the cache hits the router expected against those the worker reported) is "
         f"measured (default: {_ACCURACY.window_requests})"),
        ("--accuracy-warn-below-ratio", float, "routing accuracy below which a full window "
         "logs one WARNING about the worker, naming the likely causes "
         f"(default: {_ACCURACY.warn_below_ratio:g})"),
        ("--accuracy-min-tokens", int, "cached tokens at stake in a worker's window below "
         f"which no accuracy figure is given (default: {_ACCURACY.min_tokens})"),
        ("--accuracy-warn-interval-s", float, "least seconds between two accuracy warnings "
         f"about one worker (default: {_ACCURACY.warn_interval_s:g})"),
        ("--client-key", str, "the router's CURVE secret key file (NAME.key_secret from `kvroute "
         "keys`), presented to workers registered with server_key= (default: "
         "$KVROUTE_CLIENT_KEY, else a fresh key pair, admitted only by workers without "
         "--curve-allow)"),
    ]  # fmt: skip


_ALIASES: Final[dict[str, tuple[str, ...]]] = {
    "--predicted-ttl-s": ("--predicted-ttl",),
    "--lease-ttl-s": ("--lease-ttl",),
    "--route-hold-s": ("--route-hold",),
}
"""Flags renamed to carry their unit -> their old spellings (hidden, still accepted)."""

_RENAMED: Final = renamed_dests(_ALIASES)
"""Config-file keys of the old spellings -> the new keys."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvroute router``."""
    p = argparse.ArgumentParser(
        prog="kvroute router",
        description="Run a cache-aware router: ingests workers' KV events into a Redis prefix "
        "index and routes each request to the worker that holds most of its prefix without "
        "overloading it. Several replicas may share one Redis and namespace.",
        epilog="Keys: --admin-key guards GET/POST /v1/workers and PUT/DELETE /v1/workers/ID; "
        "--api-key guards /v1/completions, /v1/chat/completions, /v1/route and GET /v1/models "
        "(the admin key works there too). Without a key its endpoints are open: keep the "
        "router on loopback or set both. /health and /metrics are always open.",
    )
    for flag, kind, meaning in _flags():
        add_flag(p, flag, aliases=_ALIASES.get(flag, ()), type=kind, meaning=meaning)
    add_cost_arguments(p)
    for spec in (ADMIN_KEY, API_KEY, WORKER_API_KEY, WORKER_ADMIN_KEY):
        add_key_arguments(p, spec)
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="SPEC",
        help=f"register a worker: {_WORKER_USAGE} (repeatable)",
    )
    p.add_argument(
        "--tokenizer",
        action="append",
        metavar="[MODEL=]PATH",
        help="the served model's tokenizer: its tokenizer.json, or its model directory "
        "(tokenizer.json, and tokenizer_config.json whose chat template renders chat "
        "requests); MODEL=PATH for one model, PATH alone for every model without its own; "
        "repeatable. It must be the engines' own, or no prefix ever matches (default: the "
        "byte-level tokenizer of kvroute workers; a kind=vllm worker needs this or "
        "--tokenize-via-engine)",
    )
    p.add_argument(
        "--tokenize-via-engine",
        action="append",
        nargs="?",
        const="",
        metavar="MODEL",
        help="ask a worker of the model for the token ids (POST /tokenize, chat messages "
        "included: vLLM's endpoint, and the kvroute worker's), cached "
        "(--tokenize-cache-tokens); without MODEL, for every model without a --tokenizer; "
        "repeatable",
    )
    p.add_argument(
        "--allow-worker-net",
        action="append",
        metavar="NET",
        help="admit only workers whose URL and tcp:// event hosts are in this network (CIDR "
        "like 10.0.0.0/8, or one IP address) or are this exact host name; repeatable "
        "(default: any host)",
    )
    p.add_argument(
        "--require-curve",
        action="store_true",
        default=None,
        help="admit only workers registered with a CURVE server_key, so only the holder of "
        "the worker's secret key can publish its events (needs --client-key)",
    )
    p.add_argument(
        "--forward-authorization",
        action="store_true",
        default=None,
        help="pass the client's Authorization header on to the worker (default: stripped)",
    )
    p.add_argument(
        "--policy", choices=POLICY_NAMES, help=f"routing policy (default: {DEFAULT_POLICY})"
    )
    add_flag(
        p,
        "--otel",
        action="store_true",
        default_text="off, unless an OTEL_EXPORTER_* variable is set and the packages are "
        "installed",
        meaning="make OpenTelemetry spans of each request's decision and proxying, children "
        "of its traceparent (needs pip install 'kvroute[otel]')",
    )
    add_flag(
        p,
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        meaning="the event loop: uvloop (pip install 'kvroute[fast]'), asyncio's own, or "
        "auto: uvloop when installed",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p


def config_from_args(args: argparse.Namespace, redis_url: str) -> RouterConfig:
    """Merge defaults, the config file, the environment and flags into a :class:`RouterConfig`.

    Raises:
        RouterCliError: A setting is invalid.
    """
    file = load_config_file(args.config) if args.config else {}
    file = {_RENAMED.get(key, key): value for key, value in file.items()}
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
            max_body_bytes=pick("max_body_bytes", _LIMITS.max_body_bytes),
            max_prompt_tokens=pick("max_prompt_tokens", _LIMITS.max_prompt_tokens),
            body_read_timeout_s=_positive(
                "body_read_timeout_s",
                pick("body_read_timeout_s", _LIMITS.body_read_timeout_s),
            ),
        )
        proxy = ProxyConfig(
            connect_timeout_s=float(pick("proxy_connect_timeout_s", _PROXY.connect_timeout_s)),
            first_byte_timeout_s=float(
                pick("proxy_first_byte_timeout_s", _PROXY.first_byte_timeout_s)
            ),
            total_timeout_s=float(pick("proxy_total_timeout_s", _PROXY.total_timeout_s)),
            max_attempts=int(pick("max_attempts", _PROXY.max_attempts)),
            forward_authorization=bool(pick("forward_authorization", False)),
        )
        breaker = BreakerConfig(
            failure_threshold=int(pick("circuit_failures", _BREAKER.failure_threshold)),
            cooldown_s=float(pick("circuit_cooldown_s", _BREAKER.cooldown_s)),
        )
        accuracy = AccuracyConfig(
            window_requests=int(pick("accuracy_window_requests", _ACCURACY.window_requests)),
            warn_below_ratio=float(
                pick("accuracy_warn_below_ratio", _ACCURACY.warn_below_ratio)
            ),
            min_tokens=int(pick("accuracy_min_tokens", _ACCURACY.min_tokens)),
            warn_interval_s=float(pick("accuracy_warn_interval_s", _ACCURACY.warn_interval_s)),
        )
        sessions = SessionConfig(
            bonus_tokens=int(pick("session_affinity_tokens", _SESSIONS.bonus_tokens)),
            ttl_s=float(pick("session_ttl_s", _SESSIONS.ttl_s)),
            max_entries=int(pick("session_max_entries", _SESSIONS.max_entries)),
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
            timeout_s=float(pick("tokenize_timeout_s", _TOKENIZERS.timeout_s)),
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


async def _serve(args: argparse.Namespace) -> int:
    redis_url = args.redis or os.environ.get("KVROUTE_REDIS_URL")
    if redis_url is None and args.config:
        redis_url = load_config_file(args.config).get("redis")
    embedded: RedisServer | None = None
    if redis_url is None:
        embedded = RedisServer().start()
        redis_url = embedded.url
        logger.info("no --redis given: started an embedded Redis at %s", redis_url)
    try:
        config = config_from_args(args, redis_url)
        exposed = exposure_warning(config.host, *guards(config))
        if exposed is not None:
            logger.warning("%s", exposed)
        if config.proxy.forward_authorization and config.proxy.worker_key is not None:
            logger.warning(
                "--forward-authorization with --worker-api-key: workers receive the "
                "--worker-api-key, not the clients' Authorization headers"
            )
        elif config.proxy.forward_authorization and config.api_key is not None:
            logger.warning(
                "--forward-authorization with --api-key: every worker receives the "
                "router's API key in the clients' Authorization headers"
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with await RouterService.open(config) as service:
            if not (NATIVE_KEYS and NATIVE_RUNS and NATIVE_DECODE):
                logger.warning(
                    "kvroute's C modules were not built (no C compiler at install time): "
                    "event decoding, router keys and the index ingest run in Python, slower "
                    "per block; reinstall kvroute where gcc and the Python headers are present"
                )
            # Long-lived startup objects leave the GC's scans: collections triggered by
            # per-request garbage then stay short (bench_router: p50 at 64 workers).
            gc.freeze()
            ready = {"router": service.url, "redis": redact_url(redis_url),
                     "replica_id": service.load.replica_id}  # fmt: skip
            print(json.dumps(ready), flush=True)
            await stop.wait()
            logger.info("stopping the router")
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


def main(argv: Sequence[str]) -> int:
    """Entry point of ``kvroute router``; returns the exit code."""
    args = build_parser().parse_args(list(argv))
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run_on(args.event_loop, _serve(args))
    except (RouterError, EventsError, OSError, ValueError) as exc:
        logger.error("router failed: %s", exc)
        return 1
    except Exception:  # a bug: still exit with its trace rather than hang or die silently
        logger.exception("router failed")
        return 1
