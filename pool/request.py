"""A request's token state and its chained block hashes, kept current as tokens arrive."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from events.extra_keys import BlockExtraKeys, LoraAdapter, RequestExtraKeys
from events.hashing import hash_block_sha256_cbor, none_hash

__all__ = ["BlockHashFn", "BlockHasher", "Request"]

BlockHashFn: TypeAlias = Callable[[bytes, Sequence[int], "BlockExtraKeys | None"], bytes]
"""``hash_fn(parent_digest, block_token_ids, extra_keys) -> digest``, e.g. vLLM's
``sha256_cbor`` (:func:`events.hashing.hash_block_sha256_cbor`); ``extra_keys`` are the
block's tagged entries (:mod:`events.extra_keys`)."""


@dataclass(frozen=True)
class BlockHasher:
    """How a worker hashes the full blocks of its requests.

    The defaults reproduce vLLM 0.33's ``sha256_cbor`` prefix caching byte for byte: blocks
    are chained from ``none_hash`` (vLLM's seed rule: ``PYTHONHASHSEED`` whenever it is set,
    even empty, else ``"vllm-none-hash"``), ``("lora", name, path)`` is an extra key of
    every block and ``("cache_salt", salt)`` of block 0 only (the rule of
    :func:`events.hashing.hash_blocks_sha256_cbor`).

    Attributes:
        block_size: Tokens per block.
        hash_fn: The block hash function.
        none_hash: The parent digest of block 0.
    """

    block_size: int
    hash_fn: BlockHashFn = hash_block_sha256_cbor
    none_hash: bytes = field(default_factory=none_hash)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")


class Request:
    """The tokens of one request and the hashes of its full blocks.

    ``block_hashes`` grows as tokens are appended (the prompt at construction, generated
    tokens with :meth:`append_output_token_ids`), so the hash of every full block is
    computed exactly once. ``num_computed_tokens`` is advanced by the caller (the engine
    loop), as vLLM's scheduler does: the KV cache manager only reads it.

    Args:
        request_id: Unique id of the request within its worker.
        prompt_token_ids: The prompt's token ids.
        block_hasher: How to hash full blocks; ``None`` computes no hashes (prefix caching
            off for this request).
        lora: The LoRA adapter, or ``None``; its name and path are an extra key of every
            block, its name and int id go into the events.
        cache_salt: Per-tenant cache salt, or ``None``; an extra key of block 0 unless
            empty.

    Attributes:
        request_id: Unique id of the request within its worker.
        prompt_token_ids: The prompt's token ids.
        output_token_ids: The generated token ids so far.
        all_token_ids: Prompt then generated token ids.
        lora: The LoRA adapter, or ``None``.
        cache_salt: Cache salt, or ``None``.
        num_computed_tokens: Tokens whose KV is computed (or was found in the cache).
        block_hashes: Digest of each full block of ``all_token_ids``, in order.
    """

    __slots__ = (
        "_extra_keys",
        "_hasher",
        "all_token_ids",
        "block_hashes",
        "cache_salt",
        "lora",
        "num_computed_tokens",
        "output_token_ids",
        "prompt_token_ids",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_hasher: BlockHasher | None,
        *,
        lora: LoraAdapter | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # NOTE: all_token_ids == prompt_token_ids + output_token_ids at all times.
        self.all_token_ids = list(self.prompt_token_ids)
        self.lora = lora
        self.cache_salt = cache_salt
        self.num_computed_tokens = 0
        self._hasher = block_hasher
        self._extra_keys = RequestExtraKeys.of(lora, cache_salt)
        # NOTE: len(block_hashes) == num_tokens // block_size when a hasher is set, else 0.
        self.block_hashes: list[bytes] = []
        self._hash_new_full_blocks()

    @property
    def num_tokens(self) -> int:
        """Number of tokens, prompt and generated."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append generated tokens and hash every block they complete."""
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            new = list(token_ids)
            self.output_token_ids.extend(new)
            self.all_token_ids.extend(new)
        self._hash_new_full_blocks()

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter's name, or ``None``."""
        return None if self.lora is None else self.lora.name

    @property
    def lora_id(self) -> int | None:
        """The LoRA adapter's int id, or ``None``."""
        return None if self.lora is None else self.lora.int_id

    def event_extra_keys(self, start: int, stop: int) -> list[tuple[Any, ...] | None]:
        """The ``BlockStored.extra_keys`` of blocks ``start .. stop - 1``: the untagged
        form of what was hashed into each, one entry per block."""
        return self._extra_keys.event_keys(start, stop)

    def _hash_new_full_blocks(self) -> None:
        hasher = self._hasher
        if hasher is None:
            return
        size = hasher.block_size
        tokens = self.all_token_ids
        hashes = self.block_hashes
        index = len(hashes)
        stop = len(tokens) // size
        if index >= stop:
            return
        hash_fn = hasher.hash_fn
        extra = self._extra_keys
        parent = hashes[-1] if hashes else hasher.none_hash
        if index == 0:
            parent = hash_fn(parent, tokens[:size], extra.first)
            hashes.append(parent)
            index = 1
        rest = extra.rest
        for start in range(index * size, stop * size, size):
            parent = hash_fn(parent, tokens[start : start + size], rest)
            hashes.append(parent)

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, "
            f"num_block_hashes={len(self.block_hashes)})"
        )
