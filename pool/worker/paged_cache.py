"""PagedKVCache: one torch tensor holding every physical KV block, addressed by block id.

The layout is ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``.
Token ``t`` of a request lives in block ``block_ids[t // block_size]`` at offset
``t % block_size``; its flat *slot* is ``block_id * block_size + offset``. Block ids are
the BlockPool's, so the pool decides which memory a request uses and this class only
moves K/V in and out of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pool.errors import PoolError

__all__ = ["PagedCacheConfig", "PagedCacheError", "PagedKVCache"]


class PagedCacheError(PoolError, ValueError):
    """A cache shape or an addressing request is invalid."""


@dataclass(frozen=True)
class PagedCacheConfig:
    """Shape, dtype and device of a paged KV cache.

    Attributes:
        num_layers: Transformer layers (one K and one V plane each).
        num_blocks: Physical blocks; must equal the BlockPool's ``num_gpu_blocks``.
        block_size: Tokens per block.
        num_kv_heads: Key/value heads per layer.
        head_dim: Size of one head.
        dtype: Element type of the tensor.
        device: Where the tensor lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise PagedCacheError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class PagedKVCache:
    """All K/V of a worker in one preallocated tensor.

    Args:
        config: Shape, dtype and device.

    NOTE: the tensor is allocated once and never resized; a block's content is only
    meaningful for the tokens the pool says it holds (stale data is never read because
    attention reads exactly ``num_tokens`` slots of a request's block table).
    """

    def __init__(self, config: PagedCacheConfig) -> None:
        self.config = config
        c = config
        self.kv = torch.zeros(
            (c.num_layers, 2, c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim),
            dtype=c.dtype,
            device=c.device,
        )
        # A view with blocks and offsets merged into slots: [layers, 2, slots, heads, dim].
        self._slots = self.kv.view(
            c.num_layers, 2, c.num_blocks * c.block_size, c.num_kv_heads, c.head_dim
        )

    @property
    def device(self) -> torch.device:
        """The device of the cache tensor."""
        return self.kv.device

    @property
    def nbytes(self) -> int:
        """Size of the cache tensor in bytes."""
        return self.kv.numel() * self.kv.element_size()

    def slot_mapping(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Flat slots of token positions ``[start, end)`` of a request.

        Args:
            block_ids: The request's block table.
            start: First position.
            end: One past the last position.

        Returns:
            A ``long`` tensor of ``end - start`` slots on the cache's device.

        Raises:
            PagedCacheError: The positions exceed the block table or a block id is out of
                range.
        """
        bs = self.config.block_size
        if not 0 <= start <= end <= len(block_ids) * bs:
            raise PagedCacheError(
                f"positions [{start}, {end}) do not fit a table of {len(block_ids)} blocks "
                f"of {bs} tokens"
            )
        table = self._table(block_ids)
        positions = torch.arange(start, end, device=self.device)
        return table[positions // bs] * bs + positions % bs

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store K/V of some tokens of one layer.

        Args:
            layer: Layer index.
            slots: Flat slots, one per token (see :meth:`slot_mapping`).
            key: ``[num_tokens, num_kv_heads, head_dim]``.
            value: Same shape as ``key``.
        """
        self._slots[layer, 0].index_copy_(0, slots, key.to(self.kv.dtype))
        self._slots[layer, 1].index_copy_(0, slots, value.to(self.kv.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of some tokens of one layer.

        Args:
            layer: Layer index.
            slots: Flat slots, one per token, in position order.

        Returns:
            ``(key, value)``, each ``[num_tokens, num_kv_heads, head_dim]``.
        """
        return self._slots[layer, 0, slots], self._slots[layer, 1, slots]

    def _table(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = list(block_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.config.num_blocks):
            raise PagedCacheError(f"block ids must be in [0, {self.config.num_blocks}), got {ids}")
        return torch.as_tensor(ids, dtype=torch.long, device=self.device)
