"""OpenAI completion and chat request bodies, parsed into what the engine runs.

``POST /v1/completions``: ``{"prompt": str | [int] | [str] | [[int]], "model", "max_tokens"
= 16, "stream" = false, "stream_options": {"include_usage"}, "n" = 1, "stop": str | [str],
"logprobs": int, "seed", "temperature" = 0, "top_p" = 1, "top_k" = 0, "ignore_eos" = false,
"cache_salt", "add_special_tokens" = true}``. A list of strings or of token lists is a
batch: one choice per prompt (``n`` per prompt), indexed ``prompt * n + i``.

``POST /v1/chat/completions``: ``{"messages", "model", "max_completion_tokens" (or
``max_tokens``; default: the rest of the context), "logprobs": bool, "top_logprobs",
"add_generation_prompt" = true, "add_special_tokens" = false, "chat_template_kwargs",
...}`` and the same sampling fields; the messages are rendered by the worker's chat
template (:mod:`events.chat_template`).

``null`` means the default. Parameters outside these, and harmless values of the few the
worker does not implement, are :func:`pool.worker.body_fields.check_parameters`'s to refuse.
``n`` choices of one prompt sample independently; with a ``seed``, choice ``i`` samples
with ``seed + i`` (vLLM's rule), so the same request gives the same choices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from events.chat_template import ChatTemplate, ChatTemplateError
from events.tokenizer import Tokenizer
from pool.worker.body_fields import (
    CompletionRequestError,
    bool_field,
    float_field,
    int_field,
    model_request,
)
from pool.worker.sampling import SEED_MAX, SEED_MIN, SamplingParams

__all__ = [
    "MAX_CHOICES",
    "MAX_STOP_STRINGS",
    "CompletionRequest",
    "CompletionRequestError",
    "chat_prompt",
    "encode_text",
    "parse_chat_request",
    "parse_completion_request",
]

MAX_CHOICES: Final = 128
"""Most choices one request may ask for (prompts of a batch times ``n``)."""
MAX_STOP_STRINGS: Final = 16
"""Most stop strings one request may give."""
_MAX_STOP_CHARS: Final = 1024

_SAMPLING: Final = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "n",
     "stop", "stream", "stream_options", "cache_salt", "add_special_tokens", "best_of"}
)  # fmt: skip
_COMPLETION_FIELDS: Final = _SAMPLING | {"prompt", "logprobs"}
_CHAT_FIELDS: Final = _SAMPLING | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
    "chat_template_kwargs",
}  # fmt: skip


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed completion or chat request.

    Attributes:
        model: The served model name it asked for (its answer's ``model``).
        prompts: The prompts' token ids: several for a batch completion, one otherwise.
        params: How to generate each choice (its ``seed`` is choice 0's).
        n: Choices per prompt.
        stop: Strings that end a choice (left out of its text).
        stream: Answer with Server-Sent Events.
        include_usage: Stream a last chunk with the usage (``stream_options``).
        cache_salt: Hashed into the first block (see ``Engine.submit``).
    """

    model: str
    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None

    @property
    def num_choices(self) -> int:
        """Choices of the answer: ``n`` per prompt."""
        return len(self.prompts) * self.n

    def choice_params(self, choice: int) -> SamplingParams:
        """The sampling parameters of one choice: its own seed when the request has one."""
        seed = self.params.seed
        offset = choice % self.n
        if seed is None or seed == -1 or offset == 0:
            return self.params
        return _with_seed(self.params, seed + offset)

    def prompt_of(self, choice: int) -> list[int]:
        """The prompt one choice continues."""
        return self.prompts[choice // self.n]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    # Wrapped into the signed 64-bit range; -1 would mean "no seed", so it never is one.
    wrapped = (seed - SEED_MIN) % 2**64 + SEED_MIN
    return replace(params, seed=SEED_MAX if wrapped == -1 else wrapped)


def encode_text(
    tokenizer: Tokenizer, text: str, *, add_special_tokens: bool, field: str = "prompt"
) -> list[int]:
    """Token ids of a text prompt (from the request's ``field``).

    Raises:
        CompletionRequestError: The text holds a lone surrogate (no UTF-8 exists for it).
    """
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except UnicodeEncodeError as exc:  # "\ud800" is no UTF-8 text
        raise CompletionRequestError(f"{field!r} is not valid Unicode text: {exc}", field) from exc


def parse_completion_request(
    raw: bytes, tokenizer: Tokenizer, served: Sequence[str] = ("kvroute-tiny",)
) -> CompletionRequest:
    """Parse and type-check a ``/v1/completions`` body; text prompts are tokenized.

    Raises:
        CompletionRequestError: A field is malformed, out of its limits or unsupported
            (``ModelNotFoundError`` for a model not served).
    """
    body, model = model_request(raw, _COMPLETION_FIELDS, served)
    add_special = bool_field(body, "add_special_tokens", True)
    prompts = [
        encode_text(tokenizer, p, add_special_tokens=add_special) if isinstance(p, str) else p
        for p in _prompts(body.get("prompt"))
    ]
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = int_field(body, "logprobs", 0)
    return _request(body, model, prompts, 16, logprobs)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A completion's prompt as a list of prompts (one unless it is a batch)."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    is_batch = isinstance(prompt, list) and prompt
    if is_batch and (
        all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) and p for p in prompt)
    ):
        return list(prompt)
    raise CompletionRequestError(
        "'prompt' must be a string or a list of token ids (ints), or a batch of them: a "
        "non-empty list of strings or of non-empty token id lists",
        "prompt",
    )


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def parse_chat_request(
    raw: bytes,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    served: Sequence[str] = ("kvroute-tiny",),
    max_model_len: int = 0,
) -> CompletionRequest:
    """Parse a ``/v1/chat/completions`` body; its messages are rendered and tokenized.

    Args:
        raw: The body.
        tokenizer: Tokenizes the rendered prompt.
        template: Renders the messages.
        served: The model names the worker answers to.
        max_model_len: Tokens a request may reach; without a ``max_completion_tokens``
            (or ``max_tokens``) the choices may generate up to it, as in vLLM.

    Raises:
        CompletionRequestError: A field is malformed, unsupported, or the template refuses
            the messages.
    """
    body, model = model_request(raw, _CHAT_FIELDS, served)
    prompt = chat_prompt(body, tokenizer, template)
    want_logprobs = bool_field(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and not want_logprobs:
        raise CompletionRequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = int_field(body, "top_logprobs", 0) if want_logprobs else None
    default_max = max(max_model_len - len(prompt), 1)
    max_tokens = body.get("max_completion_tokens")
    name = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    return _request(body, model, [prompt], int_field(body, name, default_max), logprobs, name)


def chat_prompt(body: Mapping[str, Any], tokenizer: Tokenizer, template: ChatTemplate) -> list[int]:
    """The token ids of a chat body's ``messages`` (chat completion or ``/tokenize``).

    Reads ``messages``, ``add_generation_prompt`` (default true), ``add_special_tokens``
    (default false: the template writes them) and ``chat_template_kwargs``.

    Raises:
        CompletionRequestError: Malformed messages, or the template refuses them.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise CompletionRequestError(
            '\'messages\' must be a non-empty list of {"role", "content"} objects', "messages"
        )
    if not all(isinstance(m, dict) for m in messages):
        raise CompletionRequestError("every message must be a JSON object", "messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise CompletionRequestError(
            "'chat_template_kwargs' must be an object", "chat_template_kwargs"
        )
    try:
        text = template.render(
            messages,
            add_generation_prompt=bool_field(body, "add_generation_prompt", True),
            extra=kwargs,
        )
    except ChatTemplateError as exc:
        raise CompletionRequestError(str(exc), "messages") from exc
    add_special = bool_field(body, "add_special_tokens", False)
    return encode_text(tokenizer, text, add_special_tokens=add_special, field="messages")


def _request(
    body: Mapping[str, Any],
    model: str,
    prompts: list[list[int]],
    default_max_tokens: int,
    logprobs: int | None,
    max_tokens_name: str = "max_tokens",
) -> CompletionRequest:
    n = int_field(body, "n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise CompletionRequestError(f"'n' must be in [1, {MAX_CHOICES}], got {n}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise CompletionRequestError(
            f"'best_of' ({best_of!r}) other than 'n' is not supported by this worker", "best_of"
        )
    if len(prompts) * n > MAX_CHOICES:
        raise CompletionRequestError(
            f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; the limit is "
            f"{MAX_CHOICES}: split the batch",
            "prompt",
        )
    stream = bool_field(body, "stream", False)
    params = SamplingParams(
        max_tokens=int_field(body, max_tokens_name, default_max_tokens),
        temperature=float_field(body, "temperature", 0.0),
        ignore_eos=bool_field(body, "ignore_eos", False),
        seed=None if body.get("seed") is None else int_field(body, "seed", 0),
        top_p=float_field(body, "top_p", 1.0),
        top_k=int_field(body, "top_k", 0),
        logprobs=logprobs,
    )
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise CompletionRequestError("'cache_salt' must be a string", "cache_salt")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        params=params,
        n=n,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
        cache_salt=cache_salt or None,
    )


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise CompletionRequestError(
            "'stop' must be a non-empty string or a list of non-empty strings", "stop"
        )
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > _MAX_STOP_CHARS for s in stops):
        raise CompletionRequestError(
            f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {_MAX_STOP_CHARS} "
            "characters",
            "stop",
        )
    return tuple(dict.fromkeys(stops))


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise CompletionRequestError(
            "'stream_options' is only allowed with 'stream': true", "stream_options"
        )
    if not isinstance(options, dict):
        raise CompletionRequestError("'stream_options' must be an object", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise CompletionRequestError(
            f"unknown stream option {unknown[0]!r}: expected include_usage", "stream_options"
        )
    if bool_field(options, "continuous_usage_stats", False):
        raise CompletionRequestError(
            "stream_options.continuous_usage_stats is not supported by this worker: the "
            "usage comes in one last chunk with include_usage",
            "stream_options",
        )
    return bool_field(options, "include_usage", False)
