"""Block extra keys: what besides its tokens sets a block's hash apart, in vLLM 0.33's two forms.

A request's LoRA adapter and cache salt change the hashes of its blocks, so blocks of
different adapters or tenants never share a cache entry. vLLM 0.33 puts them into the
hash as a tuple of **tagged** entries, in this order (``docs/vllm-compat.md``, "Block hashing"):

* ``("lora", name, path)`` on every block of a LoRA request;
* ``("cache_salt", salt)`` on block 0 only, when the salt is not empty;

and ``None`` for a block with no entry. ``BlockStored`` events publish the same entries
**untagged**: each entry's second element alone (the LoRA name without its path, the bare
salt), ``None`` for a block without entries. Multimodal and prompt-embedding entries,
which kvroute workers never produce, come between the LoRA and salt entries (multimodal)
or after them (prompt embeddings) in vLLM; :func:`untagged` knows the multimodal
untagging rule (every element after the tag) so it maps any vLLM key tuple.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, TypeAlias

__all__ = [
    "CACHE_SALT_TAG",
    "LORA_TAG",
    "MM_TAG",
    "NO_EXTRA_KEYS",
    "BlockExtraKeys",
    "LoraAdapter",
    "RequestExtraKeys",
    "untagged",
]

LORA_TAG: Final = "lora"
"""Tag of the LoRA entry ``("lora", name, path)``."""

CACHE_SALT_TAG: Final = "cache_salt"
"""Tag of the cache salt entry ``("cache_salt", salt)``."""

MM_TAG: Final = "mm"
"""Tag of a multimodal entry ``("mm", mm_hash, offset)``, untagged as ``(mm_hash, offset)``."""

BlockExtraKeys: TypeAlias = tuple[tuple[Any, ...], ...]
"""The tagged entries hashed into one block (never empty: a block without any has ``None``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraAdapter:
    """The LoRA adapter a request runs with, as vLLM's ``LoRARequest`` identifies it.

    Attributes:
        name: The adapter's name (published in events as ``lora_name``).
        int_id: The adapter's integer id, at least 1 (published as ``lora_id``).
        path: The adapter's path or URI exactly as the engine was given it: vLLM hashes
            it verbatim, so the same adapter loaded from two paths never shares blocks.

    Raises:
        ValueError: A field has the wrong type, ``name`` is empty or ``int_id`` < 1.
    """

    name: str
    int_id: int
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LoRA adapter name must be a non-empty string, got {self.name!r}")
        if isinstance(self.int_id, bool) or not isinstance(self.int_id, int) or self.int_id < 1:
            raise ValueError(f"LoRA adapter int_id must be an int >= 1, got {self.int_id!r}")
        if not isinstance(self.path, str):
            raise ValueError(f"LoRA adapter path must be a string, got {self.path!r}")


def untagged(keys: BlockExtraKeys | None) -> tuple[Any, ...] | None:
    """The event form of one block's tagged extra keys.

    Args:
        keys: The tagged entries hashed into the block, or ``None``.

    Returns:
        One element per entry: the elements after the tag as a tuple for a multimodal
        entry, else the entry's second element; ``None`` when ``keys`` is ``None``.
    """
    if keys is None:
        return None
    return tuple(entry[1:] if entry[0] == MM_TAG else entry[1] for entry in keys)


@dataclass(frozen=True, slots=True)
class RequestExtraKeys:
    """The extra keys of every block of one request, hashed (tagged) and published (untagged).

    Block 0 and the later blocks differ only by the cache salt, so two of each suffice.
    Build one with :meth:`of`.

    Attributes:
        first: Tagged entries of block 0, or ``None``.
        rest: Tagged entries of every later block, or ``None``.
        event_first: ``untagged(first)``.
        event_rest: ``untagged(rest)``.
    """

    first: BlockExtraKeys | None
    rest: BlockExtraKeys | None
    event_first: tuple[Any, ...] | None
    event_rest: tuple[Any, ...] | None

    @staticmethod
    def of(lora: LoraAdapter | None = None, cache_salt: str | None = None) -> RequestExtraKeys:
        """The extra keys of a request with this adapter and salt.

        Args:
            lora: The request's LoRA adapter, or ``None``.
            cache_salt: The request's cache salt; ``None`` or ``""`` adds no entry (as vLLM).

        Returns:
            :data:`NO_EXTRA_KEYS` when neither applies (the plain path shares one object).
        """
        if lora is None and not cache_salt:
            return NO_EXTRA_KEYS
        rest: BlockExtraKeys = () if lora is None else ((LORA_TAG, lora.name, lora.path),)
        first = (*rest, (CACHE_SALT_TAG, cache_salt)) if cache_salt else rest
        return RequestExtraKeys(
            first or None, rest or None, untagged(first or None), untagged(rest or None)
        )

    def hash_keys(self, block_index: int) -> BlockExtraKeys | None:
        """The tagged entries hashed into block ``block_index`` of the request."""
        return self.first if block_index == 0 else self.rest

    def event_keys(self, start: int, stop: int) -> list[tuple[Any, ...] | None]:
        """The ``BlockStored.extra_keys`` of blocks ``start .. stop - 1``, one per block."""
        keys = [self.event_rest] * (stop - start)
        if start == 0 and stop > 0:
            keys[0] = self.event_first
        return keys


NO_EXTRA_KEYS: Final = RequestExtraKeys(None, None, None, None)
"""The extra keys of a request without LoRA adapter or cache salt."""
