"""The paged transformer: cached prefixes, batching and weights give the reference results."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pool.worker.model import DecoderModel, ForwardItem, ModelConfig, ModelError, greedy_reference
from pool.worker.paged_cache import PagedKVCache

BLOCK_SIZE = 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel(ModelConfig(seed=7))


def _prompt(length: int, salt: int = 0) -> list[int]:
    return [(31 * i + 7 * salt + 3) % 256 for i in range(length)]


def _table(num_tokens: int, first_block: int = 0) -> list[int]:
    # A scattered block table, so contiguous blocks are never assumed.
    count = -(-num_tokens // BLOCK_SIZE)
    return [(first_block + 3 * i) % 64 for i in range(count)]


def _greedy_paged(
    model: DecoderModel,
    cache: PagedKVCache,
    prompt: list[int],
    table: list[int],
    cached: int,
    max_tokens: int,
) -> tuple[torch.Tensor, list[int]]:
    """Prefill ``prompt[cached:]`` on top of ``cached`` tokens already in ``table``, then decode."""
    logits = model.forward_paged([ForwardItem(prompt[cached:], cached, table)], cache)[0]
    first_logits = logits.clone()
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(logits.argmax())
        out.append(token)
        tokens.append(token)
        logits = model.forward_paged([ForwardItem([token], len(tokens) - 1, table)], cache)[0]
    return first_logits, out


@pytest.mark.parametrize(
    ("length", "cached"),
    [(13, 0), (13, 4), (13, 12), (16, 8), (16, 12), (17, 16), (8, 4), (5, 4)],
    ids=lambda v: str(v),
)
def test_cached_prefix_gives_recomputed_logits_and_tokens(
    model: DecoderModel, length: int, cached: int
) -> None:
    # 16 and 8 end exactly on a block boundary: the last block is recomputed from 12 / 4.
    prompt = _prompt(length)
    table = _table(length + 6, first_block=5)
    reference_logits = model.forward_dense(prompt)[-1]
    reference_tokens = greedy_reference(model, prompt, 6)

    cache = model.make_cache(64, BLOCK_SIZE)
    if cached:
        # Another request computed the shared prefix into the same blocks earlier.
        model.forward_paged([ForwardItem(prompt[:cached], 0, table)], cache)
    logits, tokens = _greedy_paged(model, cache, prompt, table, cached, 6)
    torch.testing.assert_close(logits, reference_logits, atol=ATOL, rtol=0)
    assert tokens == reference_tokens


def test_prefix_written_by_another_request_is_reused_not_recomputed(model: DecoderModel) -> None:
    # The cached blocks hold the only copy of the prefix's K/V: zeroing them changes the
    # result, which proves the paged forward reads them instead of recomputing.
    prompt = _prompt(12)
    table = _table(12)
    cache = model.make_cache(64, BLOCK_SIZE)
    model.forward_paged([ForwardItem(prompt[:8], 0, table)], cache)
    good = model.forward_paged([ForwardItem(prompt[8:], 8, table)], cache)[0]
    cache.kv[:, :, table[0]] = 0.0
    bad = model.forward_paged([ForwardItem(prompt[8:], 8, table)], cache)[0]
    torch.testing.assert_close(good, model.forward_dense(prompt)[-1], atol=ATOL, rtol=0)
    assert float((good - bad).abs().max()) > 1e-2


def test_batched_prefill_and_decode_equal_one_at_a_time(model: DecoderModel) -> None:
    prompts = [_prompt(9, salt=1), _prompt(4, salt=2), _prompt(14, salt=3)]
    tables = [_table(20, first_block=0), _table(20, first_block=1), _table(20, first_block=2)]
    cache = model.make_cache(64, BLOCK_SIZE)
    # Request 1 is already decoding: 4 prompt tokens are in cache, one new token to add.
    model.forward_paged([ForwardItem(prompts[1], 0, tables[1])], cache)
    items = [
        ForwardItem(prompts[0], 0, tables[0]),
        ForwardItem([42], 4, tables[1]),
        ForwardItem(prompts[2][8:], 8, tables[2]),
    ]
    model.forward_paged([ForwardItem(prompts[2][:8], 0, tables[2])], cache)
    batched = model.forward_paged(items, cache)
    expected = torch.stack(
        [
            model.forward_dense(prompts[0])[-1],
            model.forward_dense([*prompts[1], 42])[-1],
            model.forward_dense(prompts[2])[-1],
        ]
    )
    assert batched.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(batched, expected, atol=ATOL, rtol=0)


def test_weights_are_a_function_of_the_seed() -> None:
    a, b, c = (DecoderModel(ModelConfig(seed=s)) for s in (1, 1, 2))
    tokens = _prompt(6)
    assert torch.equal(a.forward_dense(tokens), b.forward_dense(tokens))
    assert not torch.equal(a.forward_dense(tokens), c.forward_dense(tokens))


def test_safetensors_round_trip(model: DecoderModel, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    model.save_safetensors(path)
    loaded = DecoderModel.from_safetensors(path)
    assert loaded.config == model.config
    tokens = _prompt(10)
    assert torch.equal(loaded.forward_dense(tokens), model.forward_dense(tokens))
    explicit = DecoderModel.from_safetensors(path, ModelConfig(seed=99))
    assert torch.equal(explicit.forward_dense(tokens), model.forward_dense(tokens))


def test_safetensors_errors(model: DecoderModel, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    model.save_safetensors(path)
    with pytest.raises(ModelError, match="weights do not match"):
        DecoderModel.from_safetensors(path, ModelConfig(hidden_size=32))
    bare = tmp_path / "bare.safetensors"
    save_file({"x": torch.zeros(1)}, str(bare))
    with pytest.raises(ModelError, match="pass the model size flags"):
        DecoderModel.from_safetensors(bare)


def test_config_validation() -> None:
    with pytest.raises(ModelError, match="must split into 3 heads"):
        ModelConfig(hidden_size=64, num_heads=3)
    with pytest.raises(ModelError, match="num_layers must be positive, got 0"):
        ModelConfig(num_layers=0)
    with pytest.raises(ModelError, match="dtype must be one of"):
        ModelConfig(dtype="int8")
    assert ModelConfig(hidden_size=32, num_heads=2).head_dim == 16
    assert ModelConfig(hidden_size=32).mlp_size == 128


def test_cache_matches_the_model(model: DecoderModel) -> None:
    cache = model.make_cache(10, 8)
    assert tuple(cache.kv.shape) == (2, 2, 10, 8, 4, 16)
    assert cache.kv.dtype == torch.float32


def test_long_prefills_attend_in_query_chunks_with_the_same_result(
    model: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = _prompt(23)
    table = _table(23)
    whole = model.forward_dense(prompt)
    cache = model.make_cache(64, BLOCK_SIZE)
    model.forward_paged([ForwardItem(prompt[:8], 0, table)], cache)
    monkeypatch.setattr("pool.worker.model.QUERY_CHUNK", 5)
    torch.testing.assert_close(model.forward_dense(prompt), whole, atol=ATOL, rtol=0)
    paged = model.forward_paged([ForwardItem(prompt[8:], 8, table)], cache)[0]
    torch.testing.assert_close(paged, whole[-1], atol=ATOL, rtol=0)
