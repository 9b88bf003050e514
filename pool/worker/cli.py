"""``kvroute worker``: one serving worker (model, paged KV cache, engine loop, HTTP API, events).

The worker binds its HTTP API and its event sockets to loopback unless told otherwise.
When it is ready it prints one JSON line to stdout with the addresses in effect (useful
with port 0 or ``tcp://127.0.0.1:*``)::

    {"worker_id": "w0", "http": "http://127.0.0.1:8100", "events": "tcp://127.0.0.1:5557",
     "replay": null}

These are the addresses other processes dial: with ``--advertise-host`` its host replaces
the bound one (a worker bound to ``0.0.0.0`` announces ``http://worker-a:8100``). With
``--register-url`` the worker registers those addresses with that router (``PUT
/v1/workers/{id}``, retried until the router answers) and removes its registration when it
drains; a wildcard address without ``--advertise-host`` is then refused at start.

Logs go to stderr. SIGTERM or SIGINT drains the worker: new requests get 503, running and
queued ones finish, queued event batches are sent, then the process exits 0.

Every flag also reads an environment variable ``KVROUTE_WORKER_<FLAG>`` (upper case,
dashes as underscores; ``KVROUTE_WORKER_SERVED_MODEL_NAME`` takes names separated by
commas) as its default, except the bearer keys: ``--admin-key`` and
``--api-key`` (or their ``-file`` forms) fall back to ``$KVROUTE_ADMIN_KEY`` and
``$KVROUTE_API_KEY`` (or ``$..._FILE``), the names the router reads too
(:mod:`events.auth`), and ``--router-admin-key`` (the key sent to ``--register-url``) to
``$KVROUTE_ROUTER_ADMIN_KEY`` (or ``$..._FILE``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from events.auth import (
    ADMIN_KEY,
    API_KEY,
    AuthKeyError,
    KeySpec,
    SentKey,
    add_key_arguments,
    is_loopback,
    load_key,
    load_sent_key,
)
from events.chat_template import ChatTemplateError, load_chat_template
from events.cli.flags import help_text as flag_help
from events.cli.liveness import DEFAULTS as LIVENESS_DEFAULTS
from events.cli.liveness import LIVENESS_HELP, liveness_from
from events.curve import CurveKeyError, CurveKeyPair, CurveServerConfig, load_public_key
from events.endpoints import Endpoint, EndpointError
from events.publisher import EventPublisher, PublisherConfig
from events.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from pool.block_pool import MEDIUM_GPU
from pool.errors import PoolError
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.worker.addresses import WorkerAddresses, check_advertise_host
from pool.worker.engine import Engine, EngineConfig
from pool.worker.guards import ADMIN_PATHS, INFERENCE_PATHS, AccessKeys
from pool.worker.http import DEFAULT_MAX_BODY_BYTES, DEFAULT_MODEL_NAME, WorkerHTTP, WorkerInfo
from pool.worker.model import DecoderModel, ModelConfig
from pool.worker.router_registration import RouterRegistration, registration_body

__all__ = [
    "WorkerConfig",
    "build_parser",
    "config_from_args",
    "exposure_warning",
    "main",
    "serve",
]

logger = logging.getLogger("kvroute.worker")

HASH_ALGOS: Final = ("sha256_cbor",)
_DRAIN_TIMEOUT_S: Final = 120.0


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, one field per command-line flag.

    Attributes:
        worker_id: The worker's id in the cluster (flag ``--id``).
        host: HTTP listen address.
        advertise_host: The host others dial to reach this worker, put in place of the
            bound host of the HTTP URL and the ``tcp://`` endpoints it announces;
            ``None`` announces the bound addresses.
        port: HTTP port (0: any free port).
        events: Where the event PUB socket binds; ``None`` publishes nothing.
        replay: Where the replay ROUTER socket binds; ``None`` disables replay.
        topic: First frame of every event message.
        num_blocks: KV cache blocks, the null block included.
        block_size: Tokens per block.
        hash_algo: Block hash algorithm of the events.
        device: Torch device of the model and the KV cache.
        num_layers: Transformer layers.
        hidden_size: Model width.
        num_heads: Attention heads.
        intermediate_size: MLP width (0: four times the width).
        vocab_size: Vocabulary size (0: the tokenizer's).
        dtype: Weight and KV dtype.
        seed: Seed of the random weights and of sampling.
        weights: A safetensors file to load instead of random weights.
        tokenizer: A ``tokenizer.json`` or a model directory holding one (and its chat
            template); ``None`` for the byte-level tokenizer.
        chat_template: A file whose chat template renders chat requests (a
            ``tokenizer_config.json`` or a Jinja2 file); ``None``: the tokenizer
            directory's own, else the built-in one.
        max_num_seqs: Requests running at once.
        max_num_batched_tokens: Tokens computed per step.
        chunked_prefill: Split long prompts across steps (vLLM V1's default).
        served_model_name: The model names the worker answers to, as vLLM's
            ``--served-model-name``: the first is the ``model`` of answers to requests
            that name none; a request naming another gets 404 ``model_not_found``.
            Empty: the ``--weights`` path as given, else ``kvroute-tiny``.
        torch_threads: Torch intra-op CPU threads (0: torch's default).
        curve_secret_key: CURVE server secret key file; ``None`` leaves events plain.
        curve_allow: Comma-separated public key files of the clients allowed to
            subscribe; ``None`` admits any client that knows the server's public key.
        max_body_bytes: Largest HTTP request body accepted (larger: a JSON 413).
        register_url: A router's base URL to register this worker with at start (and
            remove it from on drain); ``None`` registers nowhere.
        event_heartbeat_interval_s: ZeroMQ heartbeat interval of the event and replay
            sockets (0: off).
        event_heartbeat_timeout_s: Silence after a heartbeat that drops a connection.
        event_tcp_keepalive_idle_s: Idle time before TCP keepalive probes (0: off).
        keys: Bearer keys of the admin and inference endpoints (flags ``--admin-key``,
            ``--api-key`` and their ``-file`` forms); none by default.
        router_key: The router's admin key, sent to ``register_url`` (flags
            ``--router-admin-key`` and its ``-file`` form).
    """

    worker_id: str = "worker-0"
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 8100
    events: str | None = "tcp://127.0.0.1:5557"
    replay: str | None = None
    topic: str = ""
    num_blocks: int = 1024
    block_size: int = 16
    hash_algo: str = "sha256_cbor"
    device: str = "cpu"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    intermediate_size: int = 0
    vocab_size: int = 0
    dtype: str = "float32"
    seed: int = 0
    weights: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    served_model_name: tuple[str, ...] = ()
    torch_threads: int = 0
    curve_secret_key: str | None = None
    curve_allow: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    register_url: str | None = None
    event_heartbeat_interval_s: float = LIVENESS_DEFAULTS["event_heartbeat_interval_s"]
    event_heartbeat_timeout_s: float = LIVENESS_DEFAULTS["event_heartbeat_timeout_s"]
    event_tcp_keepalive_idle_s: float = LIVENESS_DEFAULTS["event_tcp_keepalive_idle_s"]
    keys: AccessKeys = field(default_factory=AccessKeys)
    router_key: SentKey | None = None

    def __post_init__(self) -> None:
        if self.advertise_host is not None:
            object.__setattr__(self, "advertise_host", check_advertise_host(self.advertise_host))
        if self.register_url is not None and not self.register_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                f"--register-url {self.register_url!r}: expected the router's base URL, "
                "http(s)://HOST:PORT"
            )

    @property
    def model_names(self) -> tuple[str, ...]:
        """The served names in effect: the configured ones, else a name from the model."""
        if self.served_model_name:
            return self.served_model_name
        return (self.weights,) if self.weights else (DEFAULT_MODEL_NAME,)

    def model_config(self, tokenizer: Tokenizer) -> ModelConfig:
        """The model's config, its vocabulary sized by the tokenizer unless given."""
        return ModelConfig(
            vocab_size=self.vocab_size or tokenizer.vocab_size,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            seed=self.seed,
            dtype=self.dtype,
        )


_FLAGS: Final[dict[str, str]] = {"worker_id": "id"}
"""Flags whose name differs from their config field."""
_ALIASES: Final[dict[str, tuple[str, ...]]] = {"served_model_name": ("--model-name",)}
"""Config field -> older flag spellings, still accepted but not shown."""
_KEY_FIELDS: Final = frozenset({"keys", "router_key"})
"""The config fields set by key flags (:func:`events.auth.add_key_arguments`, and
:data:`ROUTER_ADMIN_KEY`'s)."""
ROUTER_ADMIN_KEY: Final = KeySpec(
    "--router-admin-key",
    "KVROUTE_ROUTER_ADMIN_KEY",
    "registering with --register-url: the router's --admin-key",
    is_sent=True,
)
"""The router's admin key, which this worker sends when it registers itself."""

_DEFAULT_TEXT: Final[dict[str, str]] = {
    "host": "127.0.0.1, loopback only",
    "advertise_host": "the bound host",
    "register_url": "none, the router is told of the worker otherwise",
    "replay": "none",
    "topic": "empty",
    "weights": "random weights from --seed",
    "tokenizer": "byte-level, as the router's",
    "chat_template": "the tokenizer directory's, else the built-in <|role|> template",
    "served_model_name": f"the --weights path, else {DEFAULT_MODEL_NAME}",
    "curve_secret_key": "none, events in the clear",
    "curve_allow": "any subscriber that has the server's public key",
}
"""Defaults whose value says little (``None``, empty), in words, for ``--help``."""

_HELP: Final[dict[str, str]] = {
    "worker_id": "worker id in the cluster",
    "host": "HTTP listen address (0.0.0.0 or :: listens on every interface)",
    "advertise_host": "host name or IP other machines reach this worker at (a compose "
    "service or pod DNS name): it replaces the bound host in the HTTP URL and tcp:// event "
    "and replay endpoints the worker announces and registers; needed to register a "
    "worker bound to a wildcard",
    "port": "HTTP port; 0 picks a free one (printed on the ready line)",
    "events": "ZeroMQ PUB endpoint the KV events bind to (tcp://HOST:* picks a port); "
    "'none' disables events",
    "replay": "ZeroMQ ROUTER endpoint for vLLM-style event replay; 'none' disables it",
    "topic": "topic frame of every event message",
    "num_blocks": "KV cache blocks, including vLLM's reserved null block",
    "block_size": "tokens per KV block",
    "hash_algo": "block hash algorithm (sha256_cbor is byte-identical to vLLM's)",
    "device": "torch device of the model and KV cache: cpu, cuda, cuda:1, ...",
    "num_layers": "transformer layers",
    "hidden_size": "model width (a multiple of --num-heads)",
    "num_heads": "attention heads",
    "intermediate_size": "MLP width; 0 means 4 x --hidden-size",
    "vocab_size": "vocabulary size; 0 means the tokenizer's",
    "dtype": "weight and KV dtype: float32, float16 or bfloat16",
    "seed": "seed of the random weights and of sampling",
    "weights": "safetensors file with the weights",
    "tokenizer": "Hugging Face tokenizer.json, or a model directory holding it (its "
    "tokenizer_config.json names the EOS token, its chat template renders chat requests)",
    "chat_template": "file whose chat template renders chat requests: a tokenizer_config.json "
    "or a Jinja2 file",
    "max_num_seqs": "requests running at once",
    "max_num_batched_tokens": "tokens one engine step computes",
    "chunked_prefill": "split prompts longer than --max-num-batched-tokens across steps, "
    "decodes keep running meanwhile (as vLLM V1 does); --no-chunked-prefill runs them alone",
    "served_model_name": "model names the worker answers to (one or more, as vLLM's flag); "
    "the first is the 'model' of answers to requests that name none, any other name gets "
    "404 model_not_found",
    "torch_threads": "torch CPU threads; 0 keeps torch's default (use 1 on a shared box)",
    "curve_secret_key": "CURVE server secret key file (NAME.key_secret from `kvroute keys`): "
    "encrypts the event and replay sockets and authenticates this worker to subscribers",
    "curve_allow": "comma-separated public key files (NAME.key) of the only subscribers "
    "allowed to connect (needs --curve-secret-key)",
    "max_body_bytes": "largest HTTP request body accepted, in bytes; a larger one gets a JSON "
    "413 error (a JSON prompt of N token ids takes about 7 x N bytes)",
    "register_url": "router base URL (http://router:8000) to register this worker with at "
    "start (PUT /v1/workers/ID, retried until the router answers) and to remove it from "
    "when it drains; sends --router-admin-key",
    **LIVENESS_HELP,
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvroute worker``: one flag per :class:`WorkerConfig` field."""
    parser = argparse.ArgumentParser(
        prog="kvroute worker",
        description="Run one kvroute worker: a small transformer over a paged KV cache with "
        "vLLM-compatible prefix caching, an OpenAI-style HTTP API and live KV events.",
    )
    for f in dataclasses.fields(WorkerConfig):
        if f.name in _KEY_FIELDS:
            continue
        name = _FLAGS.get(f.name, f.name)
        flag = "--" + name.replace("_", "-")
        env = "KVROUTE_WORKER_" + name.upper()
        raw = os.environ.get(env)
        help_text = flag_help(
            _HELP[f.name], f.default, default_text=_DEFAULT_TEXT.get(f.name), env=env
        )
        if isinstance(f.default, bool):
            enabled = f.default if raw is None else raw.lower() in ("1", "true", "yes", "on")
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=enabled,
                help=help_text,
            )
            continue
        kind: Callable[[str], Any] = (
            float if isinstance(f.default, float) else int if isinstance(f.default, int) else str
        )
        extra: dict[str, Any] = {"choices": HASH_ALGOS} if f.name == "hash_algo" else {}
        default: Any = f.default if raw is None else kind(raw)
        if isinstance(f.default, tuple):  # names, as vLLM's flag takes them
            extra["nargs"] = "+"
            default = f.default if raw is None else tuple(filter(None, raw.split(",")))
        parser.add_argument(
            flag,
            dest=f.name,
            metavar=name.upper(),
            type=kind,
            default=default,
            help=help_text,
            **extra,
        )
        for alias in _ALIASES.get(f.name, ()):
            parser.add_argument(
                alias, dest=f.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **extra
            )
    add_key_arguments(parser, ADMIN_KEY)
    add_key_arguments(parser, API_KEY)
    add_key_arguments(parser, ROUTER_ADMIN_KEY)
    parser.add_argument(
        "--log-level", default="INFO", help=flag_help("DEBUG, INFO, WARNING or ERROR", "INFO")
    )
    return parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Map parsed flags onto a :class:`WorkerConfig` (``none`` disables an endpoint).

    Raises:
        AuthKeyError: A key is given twice, unreadable or malformed.
    """
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(WorkerConfig)
        if f.name not in _KEY_FIELDS
    }
    for name in ("events", "replay", "advertise_host", "register_url"):
        if values[name] in ("", "none"):
            values[name] = None
    values["served_model_name"] = tuple(values["served_model_name"])
    keys = AccessKeys(
        admin=load_key(ADMIN_KEY, args.admin_key, args.admin_key_file),
        api=load_key(API_KEY, args.api_key, args.api_key_file),
    )
    router_key = load_sent_key(
        ROUTER_ADMIN_KEY, args.router_admin_key, args.router_admin_key_file
    )
    return WorkerConfig(**values, keys=keys, router_key=router_key)


async def serve(
    config: WorkerConfig,
    stop: asyncio.Event,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Run a worker until ``stop`` is set, then drain it and release everything.

    Args:
        config: The worker's settings.
        stop: Set it to drain and stop the worker.
        on_ready: Called once listening with ``{"worker_id", "http", "events", "replay"}``,
            the advertised addresses.

    Raises:
        TokenizerError, ModelError, EndpointError, OSError: Bad settings or a bind failed.
        RegistrationRefusedError: ``register_url`` is set and the worker cannot be
            registered (a wildcard address without ``advertise_host``, no events) or the
            router refused it.
    """
    _check_device(config.device)
    curve = _curve(config)
    if config.register_url is not None:  # refuse a wildcard before loading anything
        _registration(config, curve, _addresses(config, config.port, config.events, config.replay))
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    tokenizer = load_tokenizer(config.tokenizer)
    model_config = config.model_config(tokenizer)
    if config.weights:
        model = DecoderModel.from_safetensors(config.weights, model_config, config.device)
    else:
        model = DecoderModel(model_config, config.device)
    kv = KVCacheManager(
        KVCacheConfig(
            config.num_blocks, config.block_size, enable_kv_cache_events=config.events is not None
        )
    )
    publisher = None
    if config.events is not None:
        publisher = EventPublisher(
            PublisherConfig(
                endpoint=Endpoint.binding(config.events),
                replay_endpoint=Endpoint.binding(config.replay) if config.replay else None,
                topic=config.topic.encode(),
                curve=curve,
                liveness=liveness_from(lambda name, _: getattr(config, name)),
            )
        )
    engine = Engine(
        model,
        model.make_cache(config.num_blocks, config.block_size),
        kv,
        EngineConfig(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            enable_chunked_prefill=config.chunked_prefill,
            seed=config.seed,
        ),
        event_sink=publisher,
        eos_token_id=tokenizer.eos_token_id,
    )
    info = WorkerInfo(config.worker_id, config.model_names, config.hash_algo, MEDIUM_GPU)
    template = load_chat_template(config.chat_template, config.tokenizer)
    http = WorkerHTTP(engine, tokenizer, info, config.max_body_bytes, config.keys, template)
    engine.start()
    engine_exited = asyncio.ensure_future(asyncio.to_thread(engine.join))
    registration: RouterRegistration | None = None
    registered: asyncio.Future[bool] | None = None
    try:
        port = await http.start(config.host, config.port)
        addresses = _addresses(
            config,
            port,
            None if publisher is None else publisher.address,
            None if publisher is None else publisher.replay_address,
        )
        ready = {"worker_id": config.worker_id, **addresses.as_dict()}
        logger.info("worker ready: %s", ready)
        for warning in (exposure_warning(config.host, config.keys), _wildcard_note(addresses)):
            if warning is not None:
                logger.warning("%s", warning)
        if on_ready is not None:
            on_ready(ready)
        if config.register_url is not None:
            registration = _registration(config, curve, addresses)
            registered = asyncio.ensure_future(registration.register(stop))
        await _run_until_stopped(engine, engine_exited, stop, registered)
        logger.info("draining: finishing running and queued requests")
    finally:
        if registered is not None and registration is not None:
            registered.cancel()  # a no-op once it ended (registered, refused or stopped)
            await asyncio.gather(registered, return_exceptions=True)
            if _registered(registered):
                await registration.deregister()
        drained = await asyncio.to_thread(engine.stop, _DRAIN_TIMEOUT_S)
        if drained:
            await engine_exited
        else:
            logger.error("engine did not drain within %.0f s", _DRAIN_TIMEOUT_S)
        await http.stop()
        if publisher is not None:
            publisher.close()
    logger.info("worker %s stopped", config.worker_id)


async def _run_until_stopped(
    engine: Engine,
    engine_exited: asyncio.Future[Any],
    stop: asyncio.Event,
    registered: asyncio.Future[bool] | None,
) -> None:
    """Wait for ``stop``; raise if the engine loop ends first or the router refuses us."""
    stop_asked = asyncio.ensure_future(stop.wait())
    watched: set[asyncio.Future[Any]] = {engine_exited, stop_asked}
    if registered is not None:
        watched.add(registered)
    try:
        while not stop.is_set():
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if engine_exited in done and not stop.is_set():
                failure = engine.failure or "the engine loop ended"
                raise PoolError(f"{failure} (traceback above); the worker exits")
            if registered is not None and registered in done:
                registered.result()  # a refusal raises; registered: keep serving
                watched.discard(registered)
    finally:
        stop_asked.cancel()


def _registered(registered: asyncio.Future[bool]) -> bool:
    """Whether a registration task ended registered (not cancelled, refused or stopped)."""
    done = registered.done() and not registered.cancelled()
    return done and registered.exception() is None and registered.result()


def _addresses(
    config: WorkerConfig, port: int, events: str | None, replay: str | None
) -> WorkerAddresses:
    """The worker's addresses as announced: bound ones with the advertised host put in."""
    bound = WorkerAddresses.bound(config.host, port, events, replay)
    return bound.advertised(config.advertise_host)


def _registration(
    config: WorkerConfig, curve: CurveServerConfig | None, addresses: WorkerAddresses
) -> RouterRegistration:
    """The registration with ``config.register_url`` of a worker at ``addresses``."""
    assert config.register_url is not None
    body = registration_body(
        config.worker_id,
        addresses,
        topic=config.topic,
        block_size=config.block_size,
        models=config.model_names,
        server_key=None if curve is None else curve.keypair.public_key.decode(),
    )
    return RouterRegistration(config.register_url, body, config.router_key)


def _wildcard_note(addresses: WorkerAddresses) -> str | None:
    """The warning for announced addresses that still name a wildcard, else ``None``."""
    wildcards = addresses.wildcards
    if not wildcards:
        return None
    return (
        f"announcing {', '.join(wildcards)}: a wildcard listens on every interface but "
        "nobody can connect to it; register this worker by its reachable host, or set "
        "--advertise-host to it"
    )


def exposure_warning(host: str, keys: AccessKeys) -> str | None:
    """The warning for an HTTP API bound beyond loopback without an admin key, else ``None``.

    Names the endpoints left open (the inference ones too when they have no key either)
    and the flags that close them.
    """
    if is_loopback(host) or keys.admin is not None:
        return None
    open_paths = sorted(ADMIN_PATHS)
    harm = "reset the prefix cache and read every cached token id"
    fix = "--admin-key-file PATH (or $KVROUTE_ADMIN_KEY)"
    if keys.api is None:
        open_paths += sorted(INFERENCE_PATHS)
        harm += ", and run completions"
        fix += " and --api-key-file PATH (or $KVROUTE_API_KEY)"
    return (
        f"the HTTP API listens on {host!r}, beyond loopback, without an admin key: anyone "
        f"who reaches it can call {', '.join(open_paths)} ({harm}); set {fix}, or bind "
        "--host 127.0.0.1"
    )


def _check_device(name: str) -> None:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise PoolError(f"--device {name!r} is not a torch device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PoolError(
            f"--device {name}: no CUDA device is available (torch {torch.__version__}); "
            "use --device cpu or install a CUDA build of torch"
        )


def _curve(config: WorkerConfig) -> CurveServerConfig | None:
    if config.curve_secret_key is None:
        if config.curve_allow:
            raise CurveKeyError("--curve-allow needs --curve-secret-key")
        return None
    allowed = None
    if config.curve_allow:
        allowed = frozenset(load_public_key(p) for p in config.curve_allow.split(",") if p)
    return CurveServerConfig(CurveKeyPair.load(config.curve_secret_key), allowed)


def main(argv: Sequence[str]) -> int:
    """Entry point of ``kvroute worker``; returns the exit code."""
    args = build_parser().parse_args(list(argv))
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
        return asyncio.run(_main(config))
    except (
        PoolError,
        TokenizerError,
        ChatTemplateError,
        EndpointError,
        AuthKeyError,
        OSError,
        ValueError,
        RuntimeError,
    ) as exc:
        logger.error("worker failed: %s", exc)
        return 1


async def _main(config: WorkerConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def announce(ready: dict[str, Any]) -> None:
        print(json.dumps(ready), flush=True)

    await serve(config, stop, announce)
    return 0
