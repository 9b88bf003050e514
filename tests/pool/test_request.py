"""Request block hashes: vLLM sha256_cbor vectors, extra keys, incremental == batch."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.extra_keys import LoraAdapter
from events.hashing import hash_blocks_sha256_cbor, none_hash, wire_hash
from pool.request import BlockHasher, Request

SQL = LoraAdapter(name="sql", int_id=3, path="/adapters/sql")


@pytest.fixture(autouse=True)
def _default_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def test_vllm_test_vectors() -> None:
    request = Request("r", range(1, 33), BlockHasher(16))
    assert [wire_hash(h) for h in request.block_hashes] == [
        8866452693264111234,
        807986237951177663,
    ]


def test_partial_block_is_hashed_once_it_fills() -> None:
    request = Request("r", range(1, 30), BlockHasher(16))
    assert len(request.block_hashes) == 1
    request.append_output_token_ids([30, 31])
    assert len(request.block_hashes) == 1
    request.append_output_token_ids(32)
    assert [wire_hash(h) for h in request.block_hashes][1] == 807986237951177663
    assert request.output_token_ids == [30, 31, 32]
    assert request.all_token_ids == list(range(1, 33))
    assert (request.num_tokens, request.num_prompt_tokens) == (32, 29)


def test_vllm_test_vectors_with_lora_and_salt() -> None:
    """docs/vllm-compat.md's tagged extra keys: ("lora", name, path) on every block, then
    ("cache_salt", salt) on block 0 (the digests pinned in tests/events/test_hashing.py)."""
    lora = LoraAdapter(name="sql-adapter", int_id=7, path="/adapters/sql")
    both = Request("r", range(1, 33), BlockHasher(16), lora=lora, cache_salt="tenant-a")
    assert [wire_hash(h) for h in both.block_hashes] == [
        14092093597078032933,
        6008205350856969516,
    ]
    salted = Request("s", range(1, 33), BlockHasher(16), cache_salt="tenant-a")
    assert [wire_hash(h) for h in salted.block_hashes] == [
        5068484237151326159,
        15118032441609678279,
    ]
    adapted = Request("l", range(1, 33), BlockHasher(16), lora=lora)
    assert [wire_hash(h) for h in adapted.block_hashes] == [
        6235812900042262709,
        8854044893280796132,
    ]


def test_lora_and_cache_salt_hash_tagged_and_publish_untagged() -> None:
    tokens = list(range(100, 112))
    request = Request("r", tokens, BlockHasher(4), lora=SQL, cache_salt="tenant-a")
    assert request.block_hashes == hash_blocks_sha256_cbor(
        tokens, 4, lora=SQL, cache_salt="tenant-a"
    )
    assert (request.lora_name, request.lora_id) == ("sql", 3)
    assert request.event_extra_keys(0, 3) == [("sql", "tenant-a"), ("sql",), ("sql",)]
    assert request.event_extra_keys(1, 3) == [("sql",), ("sql",)]
    salted = Request("s", tokens, BlockHasher(4), cache_salt="tenant-a")
    assert (salted.lora_name, salted.lora_id) == (None, None)
    assert salted.event_extra_keys(0, 2) == [("tenant-a",), None]
    assert salted.block_hashes[1:] != request.block_hashes[1:]
    plain = Request("p", tokens, BlockHasher(4))
    assert plain.event_extra_keys(0, 3) == [None, None, None]
    assert plain.block_hashes == hash_blocks_sha256_cbor(tokens, 4)
    assert salted.block_hashes[0] != plain.block_hashes[0]
    empty_salt = Request("e", tokens, BlockHasher(4), cache_salt="")
    assert empty_salt.block_hashes == plain.block_hashes
    assert empty_salt.event_extra_keys(0, 2) == [None, None]


def test_custom_hash_function_and_seed() -> None:
    def sha1(parent: bytes, tokens: object, extra: object) -> bytes:
        return hashlib.sha1(parent + repr((tokens, extra)).encode()).digest()

    seed = b"seed"
    request = Request("r", [1, 2, 3, 4, 5], BlockHasher(2, sha1, seed))
    first = sha1(seed, [1, 2], None)
    assert request.block_hashes == [first, sha1(first, [3, 4], None)]
    assert BlockHasher(2).none_hash == none_hash()


def test_no_hasher_means_no_hashes() -> None:
    request = Request("r", range(64), None)
    request.append_output_token_ids(range(64))
    assert request.block_hashes == []


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        BlockHasher(0)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 50_000), max_size=40),
    chunks=st.lists(st.lists(st.integers(0, 50_000), max_size=9), max_size=8),
    lora=st.sampled_from([None, SQL]),
    cache_salt=st.sampled_from([None, "", "s"]),
)
def test_incremental_hashes_equal_hashing_all_tokens(
    prompt: list[int],
    chunks: list[list[int]],
    lora: LoraAdapter | None,
    cache_salt: str | None,
) -> None:
    request = Request("r", prompt, BlockHasher(4), lora=lora, cache_salt=cache_salt)
    for chunk in chunks:
        request.append_output_token_ids(chunk)
    expected = hash_blocks_sha256_cbor(request.all_token_ids, 4, lora=lora, cache_salt=cache_salt)
    assert request.block_hashes == expected
