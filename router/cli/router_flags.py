"""The argument parser of ``kvroute router``: its flags, their help and defaults.

:func:`router.cli.router_config.config_from_args` turns the parsed flags into a
:class:`~router.front.config.RouterConfig`; :mod:`router.cli.router` runs the router.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Final

from events.auth import ADMIN_KEY, API_KEY, WORKER_ADMIN_KEY, WORKER_API_KEY, add_key_arguments
from events.cli.flags import add_flag, renamed_dests
from events.cli.liveness import DEFAULTS as LIVENESS_DEFAULTS
from events.cli.liveness import LIVENESS_HELP
from router.cli.cost_flags import add_cost_arguments
from router.cli.event_loop import EVENT_LOOPS
from router.front.accuracy import AccuracyConfig
from router.front.breaker import BreakerConfig
from router.front.config import RequestLimits, RouterConfig
from router.front.engine_tokenizer import DEFAULT_CACHE_TOKENS
from router.front.proxy_contracts import ProxyConfig
from router.front.tokenization import TokenizerSources
from router.routing.policies import DEFAULT_POLICY, POLICY_NAMES, PolicyConfig
from router.routing.sessions import SessionConfig

__all__ = [
    "DEFAULT_ACCURACY",
    "DEFAULT_BREAKER",
    "DEFAULT_LIMITS",
    "DEFAULT_PROXY",
    "DEFAULT_SESSIONS",
    "DEFAULT_TOKENIZERS",
    "RENAMED",
    "WORKER_USAGE",
    "build_parser",
]

WORKER_USAGE = (
    "ID=HTTP_URL,events=ENDPOINT[,replay=ENDPOINT][,topic=T][,block-size=N][,kind=vllm]"
    "[,model=NAME]...[,server_key=FILE]"
)

# Defaults of the settings (slotted dataclasses keep them on instances only).
DEFAULT_PROXY = ProxyConfig()
DEFAULT_BREAKER = BreakerConfig()
DEFAULT_LIMITS = RequestLimits()
DEFAULT_ACCURACY = AccuracyConfig()
DEFAULT_SESSIONS = SessionConfig()
DEFAULT_TOKENIZERS = TokenizerSources()


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
         f"answer before asking the next (default: {DEFAULT_TOKENIZERS.timeout_s:g})"),
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
         f"included (default: {DEFAULT_PROXY.max_attempts}); only a worker that sent no answer "
         "is retried (refused, dropped or silent before its first byte, or a 503 saying it "
         "is draining or overloaded), never after a 4xx/5xx answer or once the client got a "
         "byte"),
        ("--proxy-connect-timeout-s", float, "seconds to connect to a worker, and for a silent "
         "worker to answer the GET /health liveness probe; past it the next worker is tried "
         f"(default: {DEFAULT_PROXY.connect_timeout_s:g})"),
        ("--proxy-first-byte-timeout-s", float, "seconds a worker may stay silent (before its "
         "first byte, or mid-answer) before it is probed with GET /health; if that gets no "
         "answer the worker is given up, with every request to it silent since the probe "
         "began, and each is retried elsewhere if it got no byte yet. A long prompt's "
         "prefill comes before the first byte, and a non-streamed answer comes whole after "
         "its completion, so a worker that answers the probe is waited on: this bounds "
         "failover from a frozen or cut-off worker (in about this + the connect timeout; "
         "sooner when the worker's health poll goes unanswered, which probes at once), "
         "not the length of a request; a busy worker costs one probe per this much silence "
         f"(default: {DEFAULT_PROXY.first_byte_timeout_s:g})"),
        ("--proxy-total-timeout-s", float, "seconds one proxied request may take, every "
         "attempt and the whole stream included; past it the request is ended (504 if "
         f"nothing was sent yet; default: {DEFAULT_PROXY.total_timeout_s:g})"),
        ("--body-read-timeout-s", float, "seconds a client may take to send its request body "
         f"(408 after it; default: {DEFAULT_LIMITS.body_read_timeout_s:g})"),
        ("--circuit-failures", int, "consecutive failures (connect errors, timeouts, 5xx) that "
         "open a worker's circuit, keeping it out of routing; one failure that shows the "
         "worker unreachable opens it at once "
         f"(default: {DEFAULT_BREAKER.failure_threshold})"),
        ("--circuit-cooldown-s", float, "seconds an open circuit keeps a worker out of routing "
         "before one trial request is let through (closed again on its success; default: "
         f"{DEFAULT_BREAKER.cooldown_s:g})"),
        ("--replica-id", str, "this replica's id, naming its leases, heartbeat and shared "
         "load in Redis and metrics ([A-Za-z0-9_.:@-]; default: $KVROUTE_REPLICA_ID, else a "
         "random one)"),
        ("--session-affinity-tokens", int, "prompt tokens the worker that served a request's "
         "session last (X-Session-Id header, else the body's user field) is credited with, "
         "as if cached; 0 turns session affinity off. The default is worth half a request "
         "in flight at the default weights: it wins ties and loses to any worker with one "
         "request less in flight "
         f"(default: {DEFAULT_SESSIONS.bonus_tokens})"),
        ("--session-ttl-s", float, "seconds a session is remembered after its last request "
         f"(default: {DEFAULT_SESSIONS.ttl_s:g})"),
        ("--session-max-entries", int, "most sessions remembered; past it the least recently "
         f"seen are forgotten (default: {DEFAULT_SESSIONS.max_entries})"),
        ("--accuracy-window-requests", int, "requests per worker over which routing accuracy "
         "(the cache hits the router expected against those the worker reported) is "
         f"measured (default: {DEFAULT_ACCURACY.window_requests})"),
        ("--accuracy-warn-below-ratio", float, "routing accuracy below which a full window "
         "logs one WARNING about the worker, naming the likely causes "
         f"(default: {DEFAULT_ACCURACY.warn_below_ratio:g})"),
        ("--accuracy-min-tokens", int, "cached tokens at stake in a worker's window below "
         f"which no accuracy figure is given (default: {DEFAULT_ACCURACY.min_tokens})"),
        ("--accuracy-warn-interval-s", float, "least seconds between two accuracy warnings "
         f"about one worker (default: {DEFAULT_ACCURACY.warn_interval_s:g})"),
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

RENAMED: Final = renamed_dests(_ALIASES)
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
        help=f"register a worker: {WORKER_USAGE} (repeatable)",
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
