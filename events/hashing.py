"""Block hashing: vLLM-compatible ``sha256_cbor`` for engines, fast chained keys for routers.

Two families live here because the worker and the router must agree on them:

* ``sha256_cbor`` block hashes, byte-exact with vLLM 0.33: SHA-256 over canonical CBOR of
  ``[parent_digest, [token ids...], extra_keys or None]``, chained from ``NONE_HASH``, with
  the tagged extra keys of :mod:`events.extra_keys`. On the wire a hash is the last 8
  bytes of its digest as an unsigned big-endian int.
* Router keys: XXH3-64 of a block's tokens (little-endian uint32 bytes) seeded with the
  parent's key, top bit cleared; the chain starts from a root key seeded by a namespace
  seed with the LoRA name and cache salt folded in. They never depend on an engine's hash
  algorithm or seed. 63 bits keep every key a non-negative signed 64-bit integer: Redis
  stores sets of them as compact intsets and they cross the wire as plain decimals.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence
from typing import Any, Final, NewType, cast

import cbor2
import xxhash

from events.extra_keys import BlockExtraKeys, LoraAdapter, RequestExtraKeys
from events.native import native_or

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "NATIVE_KEYS",
    "BlockHash",
    "BlockKey",
    "RouterKeyer",
    "hash_block_sha256_cbor",
    "hash_blocks_sha256_cbor",
    "none_hash",
    "python_block_keys",
    "root_key",
    "router_block_key",
    "router_block_keys",
    "wire_hash",
]

BlockHash = NewType("BlockHash", bytes)
"""An engine block hash: the full digest (32 bytes for sha256_cbor)."""

BlockKey = NewType("BlockKey", int)
"""A router key: a 63-bit chained XXH3 of a block's prefix (``0 <= key < 2**63``)."""

DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"
"""vLLM's NONE_HASH seed for ``sha256_cbor`` when ``PYTHONHASHSEED`` is not set at all."""

_ARRAY3_BYTES32: Final = b"\x83\x58\x20"  # CBOR: array(3), then bytes(32) header
_CBOR_NULL: Final = b"\xf6"
_TOKEN_TYPECODE: Final = "I"  # uint32, little-endian on every platform we support
_KEY_MASK: Final = (1 << 63) - 1


def _cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def none_hash(seed: str | None = None) -> BlockHash:
    """The parent digest of block 0.

    Args:
        seed: The seed string; ``None`` means vLLM 0.33's rule: the value of
            ``PYTHONHASHSEED`` whenever it is set, the empty string included, else
            ``"vllm-none-hash"``.

    Returns:
        ``sha256(cbor(seed))``.
    """
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    return BlockHash(hashlib.sha256(_cbor(seed)).digest())


def hash_block_sha256_cbor(
    parent: bytes, token_ids: Sequence[int], extra_keys: BlockExtraKeys | None = None
) -> BlockHash:
    """Hash one full block the way vLLM's ``sha256_cbor`` does.

    Args:
        parent: The parent block's digest (``none_hash()`` for block 0).
        token_ids: The block's token ids.
        extra_keys: The block's tagged extra keys (a tuple encodes as a CBOR array, so
            ``(("lora", name, path),)`` is an array of one 3-element array); ``None``
            when the block has none (see :class:`events.extra_keys.RequestExtraKeys`).

    Returns:
        The 32-byte SHA-256 digest.
    """
    tokens = token_ids if type(token_ids) is list else list(token_ids)
    if len(parent) != 32:
        return BlockHash(hashlib.sha256(_cbor([parent, tokens, extra_keys])).digest())
    # Same bytes as _cbor([parent, tokens, extra_keys]), without re-encoding the fixed
    # prefix (3-array, 32-byte string header): 1.8 µs instead of 2.3 (bench_pool).
    tail = _CBOR_NULL if extra_keys is None else _cbor(extra_keys)
    return BlockHash(hashlib.sha256(_ARRAY3_BYTES32 + parent + cbor2.dumps(tokens) + tail).digest())


def hash_blocks_sha256_cbor(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: bytes | None = None,
    lora: LoraAdapter | None = None,
    cache_salt: str | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hash every full block of ``token_ids``, chained, with vLLM 0.33's extra keys.

    Args:
        token_ids: The tokens of the blocks to hash; a partial last block is ignored.
        block_size: Tokens per block.
        parent: Digest of the block before the first one; ``None`` means ``none_hash()``.
        lora: The request's LoRA adapter: ``("lora", name, path)`` in every block's keys.
        cache_salt: The request's cache salt: ``("cache_salt", salt)`` in block 0's keys
            only, after the LoRA entry; ``None`` or ``""`` adds nothing.
        start_block: Index of the first block in its request (the salt applies only when
            this block is block 0).

    Returns:
        One digest per full block, in order.
    """
    extra = RequestExtraKeys.of(lora, cache_salt)
    prev = none_hash() if parent is None else parent
    out: list[BlockHash] = []
    for i in range(len(token_ids) // block_size):
        chunk = list(token_ids[i * block_size : (i + 1) * block_size])
        prev = hash_block_sha256_cbor(prev, chunk, extra.hash_keys(start_block + i))
        out.append(prev)
    return out


def wire_hash(digest: bytes) -> int:
    """The 64-bit wire form of a digest: its last 8 bytes, unsigned big-endian."""
    return int.from_bytes(digest[-8:], "big")


def root_key(
    seed: int = 0, lora_name: str | None = None, cache_salt: str | None = None
) -> BlockKey:
    """The parent key of block 0 for a request family.

    Args:
        seed: Namespace seed shared by every router and worker of a cluster.
        lora_name: LoRA adapter name; requests of different adapters never share keys.
        cache_salt: Per-tenant cache salt; salted requests never share keys with others.
            ``""`` is no salt, as for the engine (which hashes nothing for it), so the
            keys a router computes for a request agree with the keys of its events.

    Returns:
        The root key.
    """
    cache_salt = cache_salt or None
    if lora_name is None and cache_salt is None:
        return BlockKey(xxhash.xxh3_64_intdigest(b"kvroute-root", seed))
    material = _cbor(["kvroute-root", lora_name, cache_salt])
    return BlockKey(xxhash.xxh3_64_intdigest(material, seed))


def router_block_key(parent: int, token_ids: Sequence[int]) -> BlockKey:
    """The router key of one block, chained from its parent's key.

    Raises:
        OverflowError: A token id is negative or does not fit in 32 bits.
    """
    raw = array(_TOKEN_TYPECODE, token_ids).tobytes()
    return BlockKey(xxhash.xxh3_64_intdigest(raw, parent) & _KEY_MASK)


def python_block_keys(token_ids: Sequence[int], block_size: int, parent: int) -> list[BlockKey]:
    """:func:`router_block_keys` in Python: the reference the C module is tested against,
    and what runs where it was not built (no C compiler at install time)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if not 0 <= parent < 1 << 64:
        raise OverflowError("parent key does not fit in 64 bits")
    raw = array(_TOKEN_TYPECODE, token_ids).tobytes()
    step = block_size * 4
    digest = xxhash.xxh3_64_intdigest
    mask = _KEY_MASK
    keys: list[int] = []
    append = keys.append
    prev = parent
    for offset in range(0, (len(raw) // step) * step, step):
        prev = digest(raw[offset : offset + step], prev) & mask
        append(prev)
    # BlockKey is a NewType over int: the cast skips a call per key on the hot path.
    return cast("list[BlockKey]", keys)


_block_keys: Final = native_or(python_block_keys, "events._keys", "block_keys")
NATIVE_KEYS: Final = _block_keys is not python_block_keys
"""Whether router keys are computed by the C module ``events._keys`` (2-3x faster)."""


def router_block_keys(token_ids: Sequence[int], block_size: int, parent: int) -> list[BlockKey]:
    """Router keys of every full block of ``token_ids``, chained from ``parent``.

    Equals :func:`router_block_key` applied block by block (the hot path of ingest and
    routing: computed by the C module ``events._keys`` where it was built, else by
    :func:`python_block_keys`; the two agree on every input, errors included).

    Args:
        token_ids: The tokens; a partial last block is ignored.
        block_size: Tokens per block (positive).
        parent: Key of the block before the first one (``root_key(...)`` for block 0).

    Returns:
        One key per full block.

    Raises:
        OverflowError: A token id is negative or does not fit in 32 bits, or ``parent``
            does not fit in 64.
        ValueError: ``block_size`` is not positive.
    """
    return _block_keys(token_ids, block_size, parent)


class RouterKeyer:
    """Computes router keys for requests of one cluster (a fixed seed).

    Invariant: for any tokens ``t`` and split point ``k * block_size``, the keys of
    ``t`` equal the keys of ``t[:k*bs]`` followed by the keys of ``t[k*bs:]`` chained
    from the last key of the first part, so keys computed from a ``BlockStored`` that
    starts mid-request agree with keys computed from the whole prompt.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._plain_root = root_key(seed)

    def root(self, lora_name: str | None = None, cache_salt: str | None = None) -> BlockKey:
        """Root key for a request family (see :func:`root_key`)."""
        if lora_name is None and not cache_salt:
            return self._plain_root
        return root_key(self.seed, lora_name, cache_salt)

    def keys(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[BlockKey]:
        """Keys of every full block of a request's tokens, from block 0."""
        return router_block_keys(token_ids, block_size, self.root(lora_name, cache_salt))
