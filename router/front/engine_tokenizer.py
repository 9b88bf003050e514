"""Token ids from the engine itself: ``POST /tokenize`` to a worker of the model, cached.

vLLM exposes ``POST /tokenize`` (a ``prompt``, or chat ``messages`` rendered by the
model's own chat template), and so does a kvroute worker, in the same shape. Asking the
engine gives exactly the ids it will cache, whatever its tokenizer and template, at the
price of one HTTP round trip per new prompt: answers are kept in a :class:`TokenCache`,
a least-recently-used cache bounded by the number of token ids it holds, keyed by a
128-bit hash of the model and the request (so a repeated prompt costs no call).

A worker that does not answer (down, slow, a 5xx) is skipped for the next one of the
model; when none answers, the caller routes the request on load alone. A worker that
refuses the request (a 4xx: the model does not serve it, the template refuses the
messages) is final: the request is routed on load alone and the worker's own answer to
the request will say what is wrong.
"""

from __future__ import annotations

import array
import asyncio
import collections
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import aiohttp
import msgspec
import xxhash
from prometheus_client import CollectorRegistry, Counter, Gauge

from events.identity import WorkerId
from router.workers.registry import WorkerRecord

__all__ = ["DEFAULT_CACHE_TOKENS", "EngineTokenizer", "TokenCache"]

logger = logging.getLogger(__name__)

DEFAULT_CACHE_TOKENS: Final = 4 * 1024 * 1024
"""Token ids the cache holds by default (4 bytes each: 16 MiB)."""
_MAX_TOKEN_ID: Final = 0xFFFF_FFFF


class TokenCache:
    """Token id lists by key, least recently used evicted first, bounded in token ids.

    Args:
        max_tokens: Token ids held at most (an answer longer than this is not kept).
    """

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        # NOTE: ids as 4-byte unsigned arrays; num_tokens is the sum of their lengths.
        self._entries: collections.OrderedDict[bytes, array.array[int]] = collections.OrderedDict()
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> list[int] | None:
        """The ids kept under ``key`` (now the most recently used), or ``None``."""
        ids = self._entries.get(key)
        if ids is None:
            return None
        self._entries.move_to_end(key)
        return ids.tolist()

    def put(self, key: bytes, ids: Sequence[int]) -> None:
        """Keep ``ids`` under ``key``, evicting the least recently used to make room."""
        if len(ids) > self.max_tokens:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_tokens -= len(old)
        self._entries[key] = array.array("I", ids)
        self.num_tokens += len(ids)
        while self.num_tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.num_tokens -= len(evicted)


def _cache_key(model: str | None, payload: Mapping[str, Any]) -> bytes:
    return xxhash.xxh3_128_digest(msgspec.json.encode([model, payload]))


class EngineTokenizer:
    """Asks workers' ``POST /tokenize`` for token ids, through a :class:`TokenCache`.

    Args:
        session: The HTTP client session.
        timeout_s: Longest wait for one worker's answer.
        cache: Where answers are kept.
        registry: Where its metrics register.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        timeout_s: float,
        cache: TokenCache,
        registry: CollectorRegistry,
    ) -> None:
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.cache = cache
        self.requests = Counter(
            "kvroute_router_engine_tokenize",
            "Prompts tokenized by a worker's POST /tokenize, by outcome (cache_hit: "
            "answered from the router's cache; fetched: a worker answered; unavailable: a "
            "worker did not answer, the next was tried; refused: a worker refused it).",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("cache_hit", "fetched", "unavailable", "refused"):
            self.requests.labels(outcome)
        Gauge(
            "kvroute_router_engine_tokenize_cache_tokens",
            "Token ids held by the router's cache of POST /tokenize answers.",
            registry=registry,
        ).set_function(lambda: cache.num_tokens)

    async def tokens(
        self, model: str | None, payload: Mapping[str, Any], workers: Sequence[WorkerRecord]
    ) -> list[int] | None:
        """The token ids of a ``/tokenize`` request, from the cache or the first worker
        that answers (in the order given); ``None`` when none could tell.

        Args:
            model: The model (sent as the request's ``model`` when not ``None``).
            payload: The ``/tokenize`` body without ``model``: ``{"prompt", ...}`` or
                ``{"messages", ...}``.
            workers: Workers of the model, preferred first.
        """
        key = _cache_key(model, payload)
        cached = self.cache.get(key)
        if cached is not None:
            self.requests.labels("cache_hit").inc()
            return cached
        body = dict(payload) if model is None else {**payload, "model": model}
        for record in workers:
            if record.http_url is None:
                continue
            answer = await self._ask(WorkerId(record.worker_id), record.http_url, body)
            if answer == "refused":
                return None
            if answer is not None:
                self.requests.labels("fetched").inc()
                self.cache.put(key, answer)
                return answer
        return None

    async def _ask(
        self, worker_id: WorkerId, url: str, body: dict[str, Any]
    ) -> list[int] | Literal["refused"] | None:
        """The ids a worker answers; ``"refused"`` for a 4xx; ``None`` if it cannot tell."""
        try:
            async with self._session.post(
                f"{url.rstrip('/')}/tokenize", json=body, timeout=self._timeout
            ) as resp:
                raw = await resp.read()
                if 400 <= resp.status < 500:
                    self.requests.labels("refused").inc()
                    logger.info(
                        "worker %s refused POST /tokenize (HTTP %d): %s",
                        worker_id, resp.status, raw[:200].decode(errors="replace"),
                    )  # fmt: skip
                    return "refused"
                if resp.status == 200:
                    tokens = _tokens_of(raw)
                    if tokens is not None:
                        return tokens
                problem = f"HTTP {resp.status} without a token list"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        self.requests.labels("unavailable").inc()
        logger.warning("worker %s: POST /tokenize failed (%s)", worker_id, problem)
        return None


def _tokens_of(raw: bytes) -> list[int] | None:
    """The ``tokens`` of a ``/tokenize`` answer, if it holds a list of token ids."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if isinstance(tokens, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_TOKEN_ID for t in tokens
    ):
        return tokens
    return None
