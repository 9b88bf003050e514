"""Block hashing: vLLM sha256_cbor test vectors, extra keys, and router key chaining."""

from __future__ import annotations

import hashlib

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from events.hashing import (
    RouterKeyer,
    hash_block_sha256_cbor,
    hash_blocks_sha256_cbor,
    none_hash,
    root_key,
    router_block_key,
    router_block_keys,
    wire_hash,
)

NONE_HASH_HEX = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
BLOCK0_HEX = "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682"


def test_none_hash_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert none_hash().hex() == NONE_HASH_HEX
    assert none_hash("vllm-none-hash").hex() == NONE_HASH_HEX


def test_pythonhashseed_becomes_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert none_hash() == none_hash("42") != none_hash("vllm-none-hash")


def test_sha256_cbor_vectors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    first, second = hash_blocks_sha256_cbor(list(range(1, 33)), 16)
    assert first.hex() == BLOCK0_HEX
    assert wire_hash(first) == 8866452693264111234
    assert wire_hash(second) == 807986237951177663
    assert hash_block_sha256_cbor(none_hash(), range(1, 17)) == first
    assert hash_blocks_sha256_cbor(list(range(17, 33)), 16, parent=first) == [second]


def test_partial_last_block_is_not_hashed() -> None:
    assert len(hash_blocks_sha256_cbor(list(range(40)), 16)) == 2


def test_extra_keys_change_hashes_as_vllm_places_them() -> None:
    tokens = list(range(32))
    plain = hash_blocks_sha256_cbor(tokens, 16)
    salted = hash_blocks_sha256_cbor(tokens, 16, cache_salt="tenant-a")
    lora = hash_blocks_sha256_cbor(tokens, 16, lora_name="adapter")
    assert salted[0] == hash_block_sha256_cbor(none_hash(), tokens[:16], ("tenant-a",))
    # The salt applies to block 0 only; block 1 differs only through its parent.
    assert salted[1] == hash_block_sha256_cbor(salted[0], tokens[16:], None)
    assert lora[1] == hash_block_sha256_cbor(lora[0], tokens[16:], ("adapter",))
    assert len({plain[0], salted[0], lora[0]}) == 3
    # A salt given for a block that is not block 0 of its request is ignored.
    assert hash_blocks_sha256_cbor(tokens[16:], 16, parent=plain[0], cache_salt="x",
                                   start_block=1) == [plain[1]]  # fmt: skip


def test_wire_hash_is_last_8_bytes_big_endian() -> None:
    assert wire_hash(bytes(24) + bytes.fromhex("0102030405060708")) == 0x0102030405060708
    assert wire_hash(b"\xff" * 32) == 2**64 - 1


def test_router_keys_are_chained_and_seeded() -> None:
    tokens = list(range(48))
    root = root_key(7)
    keys = router_block_keys(tokens, 16, root)
    assert len(keys) == 3
    assert keys[0] == router_block_key(root, tokens[:16])
    assert keys[2] == router_block_key(keys[1], tokens[32:])
    assert router_block_keys(tokens, 16, root_key(8)) != keys
    assert all(0 <= k < 2**63 for k in keys)


def test_lora_and_salt_fold_into_the_root() -> None:
    keyer = RouterKeyer(seed=3)
    tokens = list(range(32))
    families = [
        keyer.keys(tokens, 16),
        keyer.keys(tokens, 16, lora_name="a"),
        keyer.keys(tokens, 16, lora_name="b"),
        keyer.keys(tokens, 16, cache_salt="s"),
        keyer.keys(tokens, 16, lora_name="a", cache_salt="s"),
    ]
    assert len({tuple(f) for f in families}) == len(families)
    assert keyer.keys(tokens, 16) == router_block_keys(tokens, 16, root_key(3))


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_router_keys_reject_tokens_outside_uint32(bad: list[int]) -> None:
    with pytest.raises(OverflowError):
        router_block_keys(bad * 16, 16, 0)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.integers(1, 32),
    split=st.integers(0, 10),
)
def test_router_keys_split_invariant(tokens: list[int], block_size: int, split: int) -> None:
    """Keys from a mid-request BlockStored agree with keys of the whole prompt."""
    keyer = RouterKeyer(seed=11)
    whole = keyer.keys(tokens, block_size)
    cut = min(split, len(whole)) * block_size
    head = keyer.keys(tokens[:cut], block_size)
    parent = head[-1] if head else keyer.root()
    assert head + router_block_keys(tokens[cut:], block_size, parent) == whole


@given(
    parent=st.binary(min_size=32, max_size=32) | st.binary(max_size=40),
    tokens=st.lists(st.integers(0, 2**40), max_size=40),
    extra=st.none() | st.tuples(st.text(max_size=5)) | st.tuples(st.text(), st.integers()),
)
def test_fast_cbor_path_equals_canonical_cbor(
    parent: bytes, tokens: list[int], extra: tuple[object, ...] | None
) -> None:
    expected = hashlib.sha256(cbor2.dumps([parent, tokens, extra], canonical=True)).digest()
    assert hash_block_sha256_cbor(parent, tokens, extra) == expected
