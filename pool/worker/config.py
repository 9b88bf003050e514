"""The settings of a ``kvroute worker`` (one field per flag), built from its parsed flags.

:func:`pool.worker.flags.build_parser` makes one flag of each :class:`WorkerConfig`
field; :func:`config_from_args` turns the parsed flags back into a validated config.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Final

from events.auth import ADMIN_KEY, API_KEY, KeySpec, SentKey, load_key, load_sent_key
from events.cli.liveness import DEFAULTS as LIVENESS_DEFAULTS
from events.tokenizer import Tokenizer
from pool.worker.addresses import check_advertise_host
from pool.worker.guards import AccessKeys
from pool.worker.http import DEFAULT_MAX_BODY_BYTES, DEFAULT_MODEL_NAME
from pool.worker.model import ModelConfig

__all__ = ["KEY_FIELDS", "ROUTER_ADMIN_KEY", "WorkerConfig", "config_from_args"]


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


KEY_FIELDS: Final = frozenset({"keys", "router_key"})
"""The config fields set by key flags (:func:`events.auth.add_key_arguments`, and
:data:`ROUTER_ADMIN_KEY`'s)."""
ROUTER_ADMIN_KEY: Final = KeySpec(
    "--router-admin-key",
    "KVROUTE_ROUTER_ADMIN_KEY",
    "registering with --register-url: the router's --admin-key",
    is_sent=True,
)
"""The router's admin key, which this worker sends when it registers itself."""


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Map parsed flags onto a :class:`WorkerConfig` (``none`` disables an endpoint).

    Raises:
        AuthKeyError: A key is given twice, unreadable or malformed.
    """
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(WorkerConfig)
        if f.name not in KEY_FIELDS
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
