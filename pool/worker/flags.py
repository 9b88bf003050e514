"""The argument parser of ``kvroute worker``: one flag per :class:`WorkerConfig` field, with help.

Every flag reads an environment variable ``KVROUTE_WORKER_<FLAG>`` as its default (see
:mod:`pool.worker.cli`); :func:`pool.worker.config.config_from_args` turns the parsed flags
into a :class:`WorkerConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any, Final

from events.auth import ADMIN_KEY, API_KEY, add_key_arguments
from events.cli.flags import help_text as flag_help
from events.cli.liveness import LIVENESS_HELP
from pool.worker.config import KEY_FIELDS, ROUTER_ADMIN_KEY, WorkerConfig
from pool.worker.http import DEFAULT_MODEL_NAME

__all__ = ["HASH_ALGOS", "build_parser"]

HASH_ALGOS: Final = ("sha256_cbor",)

_FLAGS: Final[dict[str, str]] = {"worker_id": "id"}
"""Flags whose name differs from their config field."""
_ALIASES: Final[dict[str, tuple[str, ...]]] = {"served_model_name": ("--model-name",)}
"""Config field -> older flag spellings, still accepted but not shown."""

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
        if f.name in KEY_FIELDS:
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
