"""The router's token ids for a request, exactly as the worker that serves it will see them.

The router keys a request's prefix from token ids, so they must be the engine's own: a
different tokenizer or chat template makes every key miss. Each model gets its ids one of
two exact ways, chosen per model:

* **a local tokenizer**: ``--tokenizer PATH`` (every model) or ``--tokenizer MODEL=PATH``
  (one model), a Hugging Face ``tokenizer.json`` or a model directory holding one; chat
  requests are rendered with the directory's chat template (``--chat-template FILE``
  overrides it), as vLLM renders them;
* **the engine**: ``--tokenize-via-engine`` (every model) or ``--tokenize-via-engine
  MODEL``: the router asks a worker of the model (``POST /tokenize``, messages included;
  :mod:`router.front.engine_tokenizer`), and caches the answers.

A model's own setting wins over the defaults, a local tokenizer over the engine. A model
with neither uses the byte-level tokenizer and built-in template of kvroute workers; a
vLLM worker (``kind=vllm``) with neither is refused, at start or at registration, with
the two fixes (:meth:`TokenizerSources.check`), since every key would miss. When the
engine cannot tell (no worker of the model answers ``/tokenize``), the request is routed
on load alone and counted in ``kvroute_router_unkeyed_requests_total{reason}``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter

from events.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from events.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from router.errors import RouterError
from router.front.engine_tokenizer import DEFAULT_CACHE_TOKENS, EngineTokenizer
from router.workers.registration import RegistrationError
from router.workers.registry import WorkerRecord

__all__ = [
    "ALL_MODELS",
    "PromptError",
    "RequestTokenizer",
    "TokenizerSources",
    "chat_tokenize_payload",
]

logger = logging.getLogger(__name__)

ALL_MODELS: Final = "*"
"""``--tokenize-via-engine`` without a model: every model without a local tokenizer."""
ENGINE: Final = "engine"
"""A model's source when its ids come from the engine's ``POST /tokenize``."""
_CHAT_TOKENIZE_FIELDS: Final = (
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "tools",
)  # fmt: skip
"""Fields of a chat request that shape its prompt: sent along to ``/tokenize`` as given."""

FIXES: Final = (
    "give the router --tokenizer PATH (the served model's tokenizer.json, or its directory "
    "with tokenizer_config.json for the chat template; --tokenizer MODEL=PATH for one "
    "model) or --tokenize-via-engine [MODEL] (ask the engine's own POST /tokenize)"
)


class PromptError(RouterError, ValueError):
    """A prompt cannot be tokenized locally (the request is at fault: a 400)."""


@dataclass(frozen=True, slots=True)
class TokenizerSources:
    """Where each model's token ids come from (see the module docstring).

    Attributes:
        default_path: ``--tokenizer PATH``: every model without its own setting.
        paths: ``--tokenizer MODEL=PATH``: model -> its tokenizer.
        via_engine: ``--tokenize-via-engine [MODEL]``: models asked to their workers
            (:data:`ALL_MODELS` for every model without a local tokenizer).
        chat_template: ``--chat-template FILE``: the chat template of every local
            tokenizer, instead of its directory's.
        cache_tokens: Token ids the engine answers' cache holds.
        timeout_s: Longest wait for one worker's ``/tokenize`` answer.
    """

    default_path: str | None = None
    paths: Mapping[str, str] = field(default_factory=dict)
    via_engine: frozenset[str] = frozenset()
    chat_template: str | None = None
    cache_tokens: int = DEFAULT_CACHE_TOKENS
    timeout_s: float = 5.0

    @classmethod
    def from_flags(
        cls,
        tokenizers: Sequence[str] = (),
        via_engine: Sequence[str] = (),
        *,
        chat_template: str | None = None,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
        timeout_s: float = 5.0,
    ) -> TokenizerSources:
        """Sources from ``--tokenizer [MODEL=]PATH`` and ``--tokenize-via-engine [MODEL]``
        values (``*`` or an empty value: every model).

        Raises:
            RouterError: A model set twice, two defaults, or a model given both ways.
        """
        default: str | None = None
        paths: dict[str, str] = {}
        for value in tokenizers:
            model, sep, path = value.partition("=")
            if not sep:
                if default is not None:
                    raise RouterError(
                        f"--tokenizer given twice without a model ({default!r}, {value!r}); "
                        "name the model of each: --tokenizer MODEL=PATH"
                    )
                default = value
            elif not model or not path or model in paths:
                raise RouterError(f"--tokenizer {value!r}: expected PATH or MODEL=PATH, once each")
            else:
                paths[model] = path
        engine = frozenset(m or ALL_MODELS for m in via_engine)
        both = sorted(set(paths) & engine)
        if both:
            raise RouterError(
                f"model {both[0]!r} has both --tokenizer and --tokenize-via-engine: choose one"
            )
        if cache_tokens < 0 or not timeout_s > 0:
            raise RouterError("--tokenize-cache-tokens must be >= 0, --tokenize-timeout-s > 0")
        return cls(default, paths, engine, chat_template, cache_tokens, timeout_s)

    def source(self, model: str | None) -> str | None:
        """A local tokenizer's path, :data:`ENGINE`, or ``None`` (nothing configured)."""
        if model is not None:
            if model in self.paths:
                return self.paths[model]
            if model in self.via_engine:
                return ENGINE
        if self.default_path is not None:
            return self.default_path
        return ENGINE if ALL_MODELS in self.via_engine else None

    def check(self, record: WorkerRecord) -> None:
        """Refuse a vLLM worker whose model has no tokenizer (every key would miss).

        A worker whose registration names no models passes when some model has its own
        setting (its models are learned from it; one without a setting is then routed
        on load alone, counted and logged).

        Raises:
            RegistrationError: Naming the worker and the two fixes.
        """
        if record.kind != "vllm" or self.source(None) is not None:
            return
        if record.models:
            missing = [m for m in record.models if self.source(m) is None]
            if not missing:
                return
            plural = "s" if len(missing) > 1 else ""
            what = f"no tokenizer for its model{plural} {', '.join(missing)}"
        elif self.paths or self.via_engine:
            return
        else:
            what = "no tokenizer"
        raise RegistrationError(
            f"worker {record.worker_id!r} is a vLLM engine (kind=vllm) and the router has "
            f"{what}: with any other tokenizer every prefix key misses; {FIXES}"
        )


def chat_tokenize_payload(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/tokenize`` body of a chat request: its messages and what shapes its prompt."""
    payload = {"messages": body.get("messages")}
    payload.update((k, body[k]) for k in _CHAT_TOKENIZE_FIELDS if body.get(k) is not None)
    return payload


class RequestTokenizer:
    """Turns a request's prompt or messages into token ids for routing.

    Args:
        sources: Where each model's ids come from.
        registry: Where its metrics register.

    Raises:
        TokenizerError, ChatTemplateError: A configured tokenizer or template cannot be
            loaded (the router does not start).
    """

    def __init__(self, sources: TokenizerSources, registry: CollectorRegistry) -> None:
        self.sources = sources
        paths = {sources.default_path, *sources.paths.values()}
        # NOTE: local tokenizers by path (None: kvroute workers' byte-level default).
        self._local: dict[str | None, tuple[Tokenizer, ChatTemplate]] = {
            path: (load_tokenizer(path), load_chat_template(sources.chat_template, path))
            for path in paths | {None}
        }
        self.engine: EngineTokenizer | None = None
        self.unkeyed = Counter(
            "kvroute_router_unkeyed_requests",
            "Requests routed on load alone for lack of token ids, by reason "
            "(engine_unavailable: no worker of the model answered POST /tokenize; "
            "no_tokenizer: a vLLM worker's model has no tokenizer configured).",
            ["reason"],
            registry=registry,
        )
        for reason in ("engine_unavailable", "no_tokenizer"):
            self.unkeyed.labels(reason)
        self._warned: set[str | None] = set()

    async def prompt_tokens(
        self,
        model: str | None,
        prompt: str,
        add_special_tokens: bool | None,
        workers: Sequence[WorkerRecord],
    ) -> list[int] | None:
        """The ids of a completion's text prompt; ``None``: route on load alone.

        Args:
            model: The request's model (resolved).
            prompt: The text.
            add_special_tokens: The request's own setting, if it gave one (default: true,
                as vLLM encodes completion prompts).
            workers: The workers of the model, preferred first.

        Raises:
            PromptError: A local tokenizer cannot encode the text.
        """
        payload: dict[str, Any] = {"prompt": prompt}
        if add_special_tokens is not None:
            payload["add_special_tokens"] = add_special_tokens
        return await self._tokens(model, payload, workers)

    async def chat_tokens(
        self, model: str | None, body: Mapping[str, Any], workers: Sequence[WorkerRecord]
    ) -> list[int] | None:
        """The ids of a chat request's rendered messages; ``None``: route on load alone.

        Raises:
            PromptError: The local chat template refuses the messages, or the text
                cannot be encoded.
        """
        return await self._tokens(model, chat_tokenize_payload(body), workers)

    async def _tokens(
        self, model: str | None, payload: Mapping[str, Any], workers: Sequence[WorkerRecord]
    ) -> list[int] | None:
        """The ids of a ``/tokenize`` payload, from the model's source (see the module doc)."""
        source = self.sources.source(model)
        if source == ENGINE:
            assert self.engine is not None, "attach the engine tokenizer before serving"
            tokens = await self.engine.tokens(model, payload, workers)
            if tokens is None:
                self.unkeyed.labels("engine_unavailable").inc()
            return tokens
        if source is None and any(r.kind == "vllm" for r in workers):
            self._no_tokenizer(model)
            return None
        tokenizer, template = self._local[source]
        # vLLM's defaults: a completion's text gets the special tokens, a rendered chat not.
        special = payload.get("add_special_tokens")
        if not isinstance(special, bool):
            special = "prompt" in payload
        try:
            if "prompt" in payload:
                text = payload["prompt"]
            else:
                text = template.render(
                    payload["messages"],
                    add_generation_prompt=payload.get("add_generation_prompt", True),
                    extra=_template_extra(payload),
                )
            return tokenizer.encode(text, add_special_tokens=special)
        except (TokenizerError, ChatTemplateError, UnicodeError) as exc:
            raise PromptError(f"the prompt cannot be tokenized: {exc}") from exc

    def _no_tokenizer(self, model: str | None) -> None:
        self.unkeyed.labels("no_tokenizer").inc()
        if model not in self._warned:
            self._warned.add(model)
            logger.warning(
                "model %s is served by vLLM workers and has no tokenizer: its requests are "
                "routed on load alone; %s",
                model,
                FIXES,
            )


def _template_extra(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Template variables of a chat request: its tools and ``chat_template_kwargs``."""
    extra: dict[str, Any] = {}
    if payload.get("tools"):
        extra["tools"] = payload["tools"]
    kwargs = payload.get("chat_template_kwargs")
    if isinstance(kwargs, dict):
        extra.update(kwargs)
    return extra
