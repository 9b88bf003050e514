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

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from events.auth import AuthKeyError, is_loopback
from events.chat_template import ChatTemplateError, load_chat_template
from events.cli.liveness import liveness_from
from events.curve import CurveKeyError, CurveKeyPair, CurveServerConfig, load_public_key
from events.endpoints import Endpoint, EndpointError
from events.publisher import EventPublisher, PublisherConfig
from events.tokenizer import TokenizerError, load_tokenizer
from pool.block_pool import MEDIUM_GPU
from pool.errors import PoolError
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.worker.addresses import WorkerAddresses
from pool.worker.config import WorkerConfig, config_from_args
from pool.worker.engine import Engine, EngineConfig
from pool.worker.flags import build_parser
from pool.worker.guards import ADMIN_PATHS, INFERENCE_PATHS, AccessKeys
from pool.worker.http import WorkerHTTP, WorkerInfo
from pool.worker.model import DecoderModel
from pool.worker.router_registration import RouterRegistration, registration_body

__all__ = ["exposure_warning", "main", "serve"]

logger = logging.getLogger("kvroute.worker")

_DRAIN_TIMEOUT_S: Final = 120.0


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
