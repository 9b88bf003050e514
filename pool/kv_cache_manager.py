"""The KVCacheManager: the blocks of each request on top of a :class:`BlockPool`.

It mirrors vLLM V1's ``KVCacheManager`` for one full-attention KV cache group, so an engine
loop written against vLLM's scheduler protocol drives it unchanged:

1. A new request: ``blocks, num_hit = get_computed_blocks(request)``, then
   ``allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)``; ``None``
   means it does not fit now (nothing changed). The caller sets
   ``request.num_computed_tokens = num_hit`` and, after the forward pass, adds the tokens
   it computed.
2. Each decode step: ``request.append_output_token_ids(token)``, then
   ``allocate_slots(request, 1)``; ``None`` means preempt (``free`` it) or wait.
3. Finished or preempted: ``free(request)``; failed (its forward pass or sampling raised):
   ``discard(request)``.

Blocks are cached as soon as their tokens are scheduled (as vLLM does), and ``take_events``
drains the pool's KV events once per step, stamping each ``BlockStored`` with the group's
KV cache spec (``kv_cache_spec_kind="full_attention"``, no sliding window) as vLLM 0.33's
manager does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from events.extra_keys import LoraAdapter
from events.hashing import hash_block_sha256_cbor, none_hash
from events.schema import BlockStored, KVCacheEvent
from pool.block import KVCacheBlock
from pool.block_pool import MEDIUM_GPU, BlockPool
from pool.request import BlockHasher, BlockHashFn, Request

__all__ = ["FULL_ATTENTION", "KVCacheConfig", "KVCacheManager", "PrefixCacheStats"]

FULL_ATTENTION: Final = "full_attention"
"""``BlockStored.kv_cache_spec_kind`` of a full-attention KV cache group (the only kind here)."""


@dataclass(frozen=True)
class KVCacheConfig:
    """Configuration of a :class:`KVCacheManager`.

    Attributes:
        num_blocks: Physical blocks in the pool, the null block included (capacity is
            ``num_blocks - 1``).
        block_size: Tokens per block.
        enable_caching: Prefix caching (hits and cached blocks); off, every request
            computes every token and no block is ever hashed.
        enable_kv_cache_events: Record KV events for :meth:`KVCacheManager.take_events`.
        medium: The ``medium`` of the events (``"GPU"`` for device blocks, as vLLM).
        hash_fn: The block hash function (vLLM's ``sha256_cbor`` by default).
        none_hash: The parent digest of block 0 (vLLM's ``NONE_HASH`` seed rule by default).
    """

    num_blocks: int
    block_size: int
    enable_caching: bool = True
    enable_kv_cache_events: bool = False
    medium: str = MEDIUM_GPU
    hash_fn: BlockHashFn = hash_block_sha256_cbor
    none_hash: bytes = field(default_factory=none_hash)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens (vLLM's ``PrefixCacheStats``).

    Every :meth:`KVCacheManager.get_computed_blocks` call counts, as in vLLM: a request
    looked up again while it waits for room counts again.

    Attributes:
        requests: Requests looked up with :meth:`KVCacheManager.get_computed_blocks`.
        queries: Tokens of those requests.
        hits: Tokens found in the cache.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates, caches and frees the KV cache blocks of running requests.

    Args:
        config: Pool size, block size, caching, events and hashing.

    Attributes:
        config: The configuration.
        block_size: Tokens per block.
        enable_caching: Whether prefix caching is on.
        block_pool: The underlying pool.
        block_hasher: The hasher that :meth:`make_request` gives requests.
    """

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.enable_caching = config.enable_caching
        self.block_hasher = BlockHasher(config.block_size, config.hash_fn, config.none_hash)
        self.block_pool = BlockPool(
            config.num_blocks,
            enable_kv_cache_events=config.enable_kv_cache_events,
            medium=config.medium,
        )
        # NOTE: a request id is in _num_cached_block iff it holds an allocation; then its
        # blocks are _req_to_blocks[id] in token order and the first _num_cached_block[id]
        # of them were cached by it (or found as hits).
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_block: dict[str, int] = {}
        self._requests = 0
        self._queries = 0
        self._hits = 0

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks that requests hold."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache counters since the manager was created."""
        return PrefixCacheStats(self._requests, self._queries, self._hits)

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        lora: LoraAdapter | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """A new :class:`Request` hashed the way this manager caches blocks.

        Its block hashes are computed only when caching is enabled.

        Args:
            request_id: Unique id of the request within this worker.
            prompt_token_ids: The prompt's token ids.
            lora: The request's LoRA adapter (name and path are hashed, name and int id
                published), or ``None``.
            cache_salt: The request's cache salt (hashed into block 0), or ``None``.
        """
        hasher = self.block_hasher if self.enable_caching else None
        return Request(request_id, prompt_token_ids, hasher, lora=lora, cache_salt=cache_salt)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a new request.

        The chain of block hashes is followed from block 0 and stops at the first miss.
        The last token is never a hit (its logits must be computed), so a request whose
        length is a multiple of the block size recomputes its last block.

        Args:
            request: A request that holds no blocks yet.

        Returns:
            The hit blocks (not yet referenced: pass them to :meth:`allocate_slots`) and the
            number of tokens they cover.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        get_one_block = self.block_pool.cached_block_hash_to_block.get_one_block
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = get_one_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self._requests += 1
        self._queries += request.num_tokens
        self._hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``, all or nothing.

        Needed are enough blocks for ``request.num_computed_tokens +
        num_new_computed_tokens + num_new_tokens`` tokens. Cache hits that sit in the free
        queue count against the free blocks, since touching them takes them out of it. On
        success the hits are referenced and appended to the request's blocks, new blocks
        follow, and every block that the scheduled tokens fill is cached (one
        ``BlockStored``).

        Args:
            request: The request; ``request.num_computed_tokens`` excludes this step.
            num_new_tokens: Tokens to compute in this step (at least 1).
            num_new_computed_tokens: Tokens covered by ``new_computed_blocks``.
            new_computed_blocks: Cache hits from :meth:`get_computed_blocks`; only for a
                request that holds no blocks yet.

        Returns:
            The newly allocated blocks (possibly empty), or ``None`` when they do not fit;
            then nothing changed.

        Raises:
            ValueError: ``num_new_tokens`` is not positive, or hits are given for a request
                that already holds blocks.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be at least 1, got {num_new_tokens}")
        hits: Sequence[KVCacheBlock] = new_computed_blocks or ()
        request_id = request.request_id
        req_blocks = self._req_to_blocks.get(request_id)
        if hits and req_blocks is not None:
            raise ValueError(
                f"request {request_id!r} already holds blocks; cache hits are only "
                "accepted on its first allocation"
            )
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed_tokens + num_new_tokens
        num_held = len(hits) + (0 if req_blocks is None else len(req_blocks))
        num_new_blocks = max(0, -(-num_tokens // self.block_size) - num_held)
        num_evictable_hits = sum(1 for block in hits if block.ref_cnt == 0)
        pool = self.block_pool
        if num_new_blocks + num_evictable_hits > pool.get_num_free_blocks():
            return None
        if req_blocks is None:
            req_blocks = self._req_to_blocks[request_id] = []
            self._num_cached_block[request_id] = len(hits)
        if hits:
            pool.touch(hits)
            req_blocks.extend(hits)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_blocks(request, req_blocks, min(num_tokens, request.num_tokens))
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the blocks of a finished or preempted request, last block first.

        Freed cached blocks stay findable until reused; the request's last blocks are
        evicted before its prefix, which other requests are likelier to share. Freeing a
        request that holds no blocks does nothing.
        """
        blocks = self._req_to_blocks.pop(request.request_id, None)
        self._num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def discard(self, request: Request) -> None:
        """Release the blocks of a request whose computation failed.

        Its blocks that no other request holds leave the prefix cache first (a
        ``BlockRemoved`` each): they were cached when scheduled, before the failed step
        wrote their K/V, so a later hit would read garbage. Blocks other requests hold
        stay cached (they are theirs as much). Discarding a request that holds no blocks
        does nothing.
        """
        blocks = self._req_to_blocks.get(request.request_id, ())
        self.block_pool.evict_blocks(block.block_id for block in blocks if block.ref_cnt == 1)
        self.free(request)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block ids a request holds, in token order: its row of the block table."""
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no request holds blocks.

        Returns:
            True on success, False while blocks are in use.
        """
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's KV events since the last call, in emission order.

        Each ``BlockStored`` gets ``kv_cache_spec_kind="full_attention"`` (its
        ``kv_cache_spec_sliding_window`` stays ``None``): the spec of the one group.
        """
        events = self.block_pool.take_events()
        for event in events:
            if type(event) is BlockStored:
                event.kv_cache_spec_kind = FULL_ATTENTION
        return events

    def _cache_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        request_id = request.request_id
        num_cached = self._num_cached_block[request_id]
        num_full = num_tokens // self.block_size
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                request, blocks, num_cached, num_full, self.block_size
            )
            self._num_cached_block[request_id] = num_full
