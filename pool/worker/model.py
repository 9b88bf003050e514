"""A small decoder-only transformer whose attention reads and writes K/V through block tables.

The model is a pre-norm Llama-style stack (RMSNorm, rotary positions, SiLU-gated MLP)
with deterministic random weights from a seed, or weights from a safetensors file. Its
paged forward computes only the tokens a request has not cached yet: their K/V go into
the :class:`PagedKVCache` slots of the request's blocks, and attention reads the whole
context (cached prefix plus new tokens) back from those slots. The dense forward, which
never touches a cache, is the reference the paged path must agree with.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from events.tokenizer import BYTE_VOCAB_SIZE
from pool.errors import PoolError
from pool.worker.paged_cache import PagedCacheConfig, PagedKVCache

__all__ = ["DecoderModel", "ForwardItem", "ModelConfig", "ModelError", "greedy_reference"]

_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_METADATA_KEY: Final = "kvroute.model_config"
QUERY_CHUNK: Final = 1024
"""Queries attended at once in a long prefill (bounds the score matrix)."""


class ModelError(PoolError, ValueError):
    """A model configuration or weight file is invalid."""


@dataclass(frozen=True)
class ModelConfig:
    """Size and numerics of the model.

    Attributes:
        vocab_size: Number of token ids (the byte tokenizer's by default).
        num_layers: Transformer blocks.
        hidden_size: Width of the residual stream; a multiple of ``num_heads``.
        num_heads: Attention heads (each is also a K/V head).
        intermediate_size: Width of the MLP; 0 means ``4 * hidden_size``.
        rope_theta: Base of the rotary position frequencies.
        seed: Seed of the random weights.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    """

    vocab_size: int = BYTE_VOCAB_SIZE
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden_size", "num_heads"):
            if getattr(self, name) <= 0:
                raise ModelError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.head_dim % 2:
            raise ModelError(
                f"hidden_size {self.hidden_size} must split into {self.num_heads} heads of "
                "an even size"
            )
        if self.dtype not in _DTYPES:
            raise ModelError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def mlp_size(self) -> int:
        """Width of the MLP."""
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of weights and KV."""
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class ForwardItem:
    """One request's share of a paged forward step.

    Attributes:
        token_ids: The tokens to compute now (not yet in the cache), in order.
        start_pos: Position of the first of them = tokens the request already has in cache.
        block_ids: The request's block table, covering ``start_pos + len(token_ids)``.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int] = field(default_factory=list)


class _Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * config.mlp_size, bias=False)
        self.down = nn.Linear(config.mlp_size, h, bias=False)

    @staticmethod
    def checked(module: nn.Module) -> _Layer:
        assert isinstance(module, _Layer)
        return module


class DecoderModel(nn.Module):
    """The decoder-only transformer.

    Args:
        config: Model size and numerics.
        device: Where the weights live.
    """

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))
        self._layers: list[_Layer] = [_Layer.checked(m) for m in self.layers]
        self.final_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights(config.seed)
        self.to(device=device, dtype=config.torch_dtype)
        self.eval()
        half = config.head_dim // 2
        inv_freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        self._inv_freq = inv_freq.to(device=device, dtype=torch.float32)

    @property
    def device(self) -> torch.device:
        """The device of the weights."""
        return self.lm_head.weight.device

    def _init_weights(self, seed: int) -> None:
        # Drawn on the CPU in a fixed order so a seed means the same weights on any device.
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(self.named_parameters()):
                if name.endswith("norm"):
                    param.fill_(1.0)
                    continue
                fan_in = param.shape[-1] if not name.startswith("embed") else 1
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))

    def make_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """A paged KV cache shaped for this model, on the model's device."""
        c = self.config
        return PagedKVCache(
            PagedCacheConfig(
                num_layers=c.num_layers,
                num_blocks=num_blocks,
                block_size=block_size,
                num_kv_heads=c.num_heads,
                head_dim=c.head_dim,
                dtype=c.torch_dtype,
                device=str(self.device),
            )
        )

    def save_safetensors(self, path: str | Path) -> None:
        """Write the weights, with the config in the file's metadata."""
        from safetensors.torch import save_file

        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={_METADATA_KEY: json.dumps(asdict(self.config))})

    @classmethod
    def from_safetensors(
        cls, path: str | Path, config: ModelConfig | None = None, device: str = "cpu"
    ) -> DecoderModel:
        """Load a model from a safetensors file.

        Args:
            path: The weight file.
            config: The model's config; ``None`` reads it from the file's metadata
                (written by :meth:`save_safetensors`).
            device: Where the weights go.

        Raises:
            ModelError: The file has no config and none was given, or its tensors do not
                match the config.
        """
        from safetensors import safe_open
        from safetensors.torch import load_file

        if config is None:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
            if _METADATA_KEY not in meta:
                raise ModelError(
                    f"{path}: no {_METADATA_KEY!r} metadata; pass the model size flags"
                )
            config = ModelConfig(**json.loads(meta[_METADATA_KEY]))
        model = cls(config, device=device)
        tensors = load_file(str(path), device=str(model.device))
        try:
            model.load_state_dict({k: v.to(config.torch_dtype) for k, v in tensors.items()})
        except RuntimeError as exc:
            raise ModelError(f"{path}: weights do not match {config}: {exc}") from exc
        return model

    @torch.inference_mode()
    def forward_paged(self, items: Sequence[ForwardItem], cache: PagedKVCache) -> torch.Tensor:
        """Compute the new tokens of a batch of requests through the paged cache.

        Args:
            items: One entry per request; each has at least one new token.
            cache: The paged cache the block tables point into.

        Returns:
            Logits of each item's last token, ``[len(items), vocab_size]``, float32.
        """
        plan = _PagedPlan(items, cache)
        tokens = [t for item in items for t in item.token_ids]
        x = self.embed(torch.as_tensor(tokens, dtype=torch.long, device=self.device))
        rope = self._rope(plan.positions)
        for index, layer in enumerate(self._layers):
            q, k, v = self._qkv(layer, x, rope)
            cache.write(index, plan.write_slots, k, v)
            x = self._finish_layer(layer, x, plan.attend(index, q, cache))
        return self._logits(x[plan.last_rows])

    @torch.inference_mode()
    def forward_dense(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Reference forward over a whole sequence, without any cache.

        Returns:
            Logits of every position, ``[len(token_ids), vocab_size]``, float32.
        """
        device = self.device
        x = self.embed(torch.as_tensor(list(token_ids), dtype=torch.long, device=device))
        rope = self._rope(torch.arange(len(token_ids), device=device))
        for layer in self._layers:
            q, k, v = self._qkv(layer, x, rope)
            x = self._finish_layer(layer, x, _attend(q, k, v, 0))
        return self._logits(x)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        dtype = self.config.torch_dtype
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        h = F.rms_norm(x, (c.hidden_size,), layer.attn_norm)
        q, k, v = layer.qkv(h).view(-1, 3, c.num_heads, c.head_dim).unbind(1)
        return _rotate(q, rope), _rotate(k, rope), v

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = x + layer.out(attn.reshape(-1, c.hidden_size))
        gate, up = layer.gate_up(F.rms_norm(x, (c.hidden_size,), layer.mlp_norm)).chunk(2, -1)
        mlp: torch.Tensor = layer.down(F.silu(gate) * up)
        return x + mlp

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, (self.config.hidden_size,), self.final_norm)
        logits: torch.Tensor = self.lm_head(h)
        return logits.float()


class _PagedPlan:
    """The addressing of one paged step, computed once and used by every layer.

    Single-token items (decodes) are attended together in one padded batch; longer items
    (prefills) one by one, each with its causal mask.
    """

    def __init__(self, items: Sequence[ForwardItem], cache: PagedKVCache) -> None:
        device = cache.device
        lengths = [len(item.token_ids) for item in items]
        spans = [(item.start_pos, item.start_pos + len(item.token_ids)) for item in items]
        self.positions = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
        self.write_slots = torch.cat(
            [cache.slot_mapping(i.block_ids, a, b) for i, (a, b) in zip(items, spans, strict=True)]
        )
        contexts = [
            cache.slot_mapping(i.block_ids, 0, b) for i, (_, b) in zip(items, spans, strict=True)
        ]
        first_rows = [0, *itertools.accumulate(lengths)][:-1]
        self.last_rows = torch.tensor(
            [first + n - 1 for first, n in zip(first_rows, lengths, strict=True)], device=device
        )
        # (first row, token count, start position, context slots) of each prefill.
        self.prefills = [
            (first_rows[row], n, spans[row][0], contexts[row])
            for row, n in enumerate(lengths)
            if n > 1
        ]
        decodes = [row for row, n in enumerate(lengths) if n == 1]
        self.decode_rows = self.last_rows[decodes]
        self.decode_slots: torch.Tensor | None = None
        self.decode_mask: torch.Tensor | None = None
        if decodes:
            # Padding reads slot 0 (inside the pool's never-allocated null block); masked.
            self.decode_slots = pad_sequence(
                [contexts[row] for row in decodes], batch_first=True, padding_value=0
            )
            widths = torch.tensor([spans[row][1] for row in decodes], device=device)
            columns = torch.arange(self.decode_slots.shape[1], device=device)
            self.decode_mask = (columns[None, :] < widths[:, None])[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """Attention output of every new token of the step, ``[tokens, heads, head_dim]``."""
        out = torch.empty_like(q)
        for first, n, start, slots in self.prefills:
            key, value = cache.read(layer, slots)
            out[first : first + n] = _attend(q[first : first + n], key, value, start)
        if self.decode_slots is not None:
            key, value = cache.read(layer, self.decode_slots)  # [batch, width, heads, dim]
            attn = F.scaled_dot_product_attention(
                q[self.decode_rows][:, :, None, :],
                key.transpose(1, 2),
                value.transpose(1, 2),
                attn_mask=self.decode_mask,
            )
            out[self.decode_rows] = attn[:, :, 0, :]
        return out


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope
    first, second = x.chunk(2, -1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), -1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Causal attention of queries at positions ``start_pos + i`` over keys ``0..``.

    Long prompts are attended ``QUERY_CHUNK`` queries at a time, each chunk over the keys
    it can see, so the score matrix never exceeds ``QUERY_CHUNK x num_keys`` (CPU SDPA
    materialises it: a 8,192-token prompt would otherwise need ~1 GB per layer).

    Args:
        q: ``[num_queries, heads, head_dim]``.
        k: ``[num_keys, heads, head_dim]`` with ``num_keys = start_pos + num_queries``.
        v: Same shape as ``k``.
        start_pos: Position of the first query.

    Returns:
        ``[num_queries, heads, head_dim]``.
    """
    num_q = q.shape[0]
    chunks = [
        _attend_chunk(q[i : i + QUERY_CHUNK], k, v, start_pos + i)
        for i in range(0, num_q, QUERY_CHUNK)
    ]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _attend_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int
) -> torch.Tensor:
    num_q = q.shape[0]
    num_k = start_pos + num_q  # later keys are masked for every query of the chunk
    mask = None
    if num_q > 1:
        query_pos = torch.arange(start_pos, num_k, device=q.device)
        mask = torch.arange(num_k, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k[:num_k].transpose(0, 1), v[:num_k].transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


def greedy_reference(
    model: DecoderModel, prompt: Sequence[int], max_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """Greedy continuation of ``prompt`` by full recomputation, without any KV cache.

    The no-cache reference that paged, cached and batched generation must reproduce.

    Args:
        model: The model.
        prompt: Prompt token ids (at least one).
        max_tokens: Tokens to generate at most.
        eos_token_id: Stop after generating this id; ``None`` never stops early.

    Returns:
        The generated token ids.
    """
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(model.forward_dense(tokens)[-1].argmax())
        out.append(token)
        tokens.append(token)
        if token == eos_token_id:
            break
    return out
