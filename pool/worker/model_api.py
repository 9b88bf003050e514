"""The worker's model endpoints: ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``.

Shapes follow vLLM's, so a router asks a kvroute worker and a vLLM engine the same way:

* ``GET /v1/models``: ``{"object": "list", "data": [{"id", "object": "model", "created",
  "owned_by": "kvroute", "root", "parent": null, "max_model_len"}, ...]}``, one entry per
  served name (``--served-model-name``);
* ``POST /tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages",
  "add_generation_prompt": true, "add_special_tokens": false, "chat_template_kwargs"}``
  (rendered by the worker's chat template), optional ``"model"`` and
  ``"return_token_strs"``; answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
* ``POST /detokenize``: ``{"tokens": [int], "model"}``; answers ``{"prompt"}``.

A ``model`` the worker does not serve gets 404 ``model_not_found``, as completions do.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

from aiohttp import web

from events.chat_template import ChatTemplate
from events.tokenizer import Tokenizer
from pool.worker.body_fields import (
    CompletionRequestError,
    bool_field,
    model_request,
)
from pool.worker.completions import chat_prompt, encode_text

__all__ = ["ModelAPI"]

_TOKENIZE_FIELDS: Final = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
     "chat_template_kwargs", "return_token_strs"}
)  # fmt: skip
_DETOKENIZE_FIELDS: Final = frozenset({"model", "tokens"})


class ModelAPI:
    """What a worker serves and how it tokenizes, over HTTP.

    Args:
        served: The model names the worker answers to (the first one is its own).
        tokenizer: The worker's tokenizer.
        template: Its chat template.
        max_model_len: Prompt plus generated tokens one request may reach.
        vocab_size: Token ids below it are valid.
    """

    def __init__(
        self,
        served: Sequence[str],
        tokenizer: Tokenizer,
        template: ChatTemplate,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.served = tuple(served)
        self.tokenizer = tokenizer
        self.template = template
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._created = int(time.time())

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``."""
        data = [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "kvroute",
                "root": self.served[0],
                "parent": None,
                "max_model_len": self.max_model_len,
            }
            for name in self.served
        ]
        return web.json_response({"object": "list", "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        """``POST /tokenize``.

        Raises:
            CompletionRequestError: A malformed or unsupported body (answered as 400/404).
        """
        body, _ = model_request(await request.read(), _TOKENIZE_FIELDS, self.served)
        if ("prompt" in body) == ("messages" in body):
            raise CompletionRequestError("send either 'prompt' (a string) or 'messages'", "prompt")
        if "messages" in body:
            tokens = chat_prompt(body, self.tokenizer, self.template)
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise CompletionRequestError("'prompt' must be a string", "prompt")
            add_special = bool_field(body, "add_special_tokens", True)
            tokens = encode_text(self.tokenizer, prompt, add_special_tokens=add_special)
        answer: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }
        if bool_field(body, "return_token_strs", False):
            answer["token_strs"] = [self.tokenizer.decode([t]) for t in tokens]
        return web.json_response(answer)

    async def detokenize(self, request: web.Request) -> web.Response:
        """``POST /detokenize``.

        Raises:
            CompletionRequestError: A malformed or unsupported body (answered as 400/404).
        """
        body, _ = model_request(await request.read(), _DETOKENIZE_FIELDS, self.served)
        tokens = body.get("tokens")
        if not (
            isinstance(tokens, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
        ):
            raise CompletionRequestError("'tokens' must be a list of token ids (ints)", "tokens")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise CompletionRequestError(
                f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}", "tokens"
            )
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})
