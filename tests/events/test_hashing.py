"""Block hashing: vLLM sha256_cbor test vectors, extra keys, and router key chaining.

The vectors with extra keys follow docs/vllm-compat.md's "Block hashing" (vLLM 0.33): tagged
entries ``("lora", name, path)`` on every block, then ``("cache_salt", salt)`` on block 0.
Each is computed here by an independent route (the CBOR written out, by hand or with
cbor2 over lists) and pinned as a literal, so a drift in either fails.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from typing import Any

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from events.extra_keys import LoraAdapter, RequestExtraKeys, untagged
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
BLOCK1_HEX = "2533ea50426b36e9e4d68296cac6bce8cf602e46957d0fe40b368b33d87bf3bf"

DEFAULT_SEED = "vllm-none-hash"
SALT = "tenant-a"
LORA = LoraAdapter(name="sql-adapter", int_id=7, path="/adapters/sql")
# (block 0 digest, block 1 digest) of tokens 1..32 in blocks of 16, default seed.
SALTED_HEX = (
    "d4fdd9f3dab139eafd01550f43781481256e9531b59b55ea4656df8f49124fcf",
    "2f4337ba796128f8f0f3e95e4b2e30a948abce017020918ad1ce0a6828f9edc7",
)
LORA_HEX = (
    "3e2e31c4c6fc9ce4ba4c4b506a8d3d6fe660ce1f957476b3568a0ecb38d148b5",
    "26d67be6d557dcbcd33ec2690a5c67c86657ba737e4b35037adfe2eb715cfde4",
)
LORA_SALTED_HEX = (
    "133ff4f63a59bc8686244082079707a7cf2b8bbbd676eca3c3912c76a3649225",
    "04a93fb7d151552fa1fc9d00ff7af3e3ddbbe9b84e5fffb353616eef0b6e4d2c",
)
# NONE_HASH = sha256(cbor(seed)) for PYTHONHASHSEED values ("" is a seed too).
SEEDED_NONE_HASH_HEX = {
    "": "8d33f520a3c4cef80d2453aef81b612bfe1cb44c8b2025630ad38662763f13d3",
    "0": "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
    "123": "9bf5bb3e4bd40e48b2a893d8928a13c0289f9a74404437ffc44070135c95f290",
}


def spec_chain(extra0: list[Any] | None, extra1: list[Any] | None) -> tuple[bytes, bytes]:
    """Tokens 1..32 in two blocks hashed straight from the spec: the CBOR array
    ``[parent, tokens, extra]`` built from lists (CBOR arrays) by cbor2, then SHA-256."""
    none = hashlib.sha256(cbor2.dumps(DEFAULT_SEED)).digest()
    first = hashlib.sha256(cbor2.dumps([none, list(range(1, 17)), extra0])).digest()
    second = hashlib.sha256(cbor2.dumps([first, list(range(17, 33)), extra1])).digest()
    return first, second


def test_none_hash_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert none_hash().hex() == NONE_HASH_HEX
    assert none_hash("vllm-none-hash").hex() == NONE_HASH_HEX


def test_pythonhashseed_becomes_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert none_hash() == none_hash("42") != none_hash("vllm-none-hash")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [None, "", "0", "123"])
def test_none_hash_in_a_process_started_with_pythonhashseed(seed: str | None) -> None:
    """vLLM 0.33 seeds NONE_HASH with PYTHONHASHSEED whenever it is set, "" included."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    code = "from events.hashing import none_hash; print(none_hash().hex())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    expected = NONE_HASH_HEX if seed is None else SEEDED_NONE_HASH_HEX[seed]
    assert done.stdout.strip() == expected
    spec_seed = DEFAULT_SEED if seed is None else seed
    assert expected == hashlib.sha256(cbor2.dumps(spec_seed)).hexdigest()


def test_sha256_cbor_vectors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    first, second = hash_blocks_sha256_cbor(list(range(1, 33)), 16)
    assert first.hex() == BLOCK0_HEX
    assert wire_hash(first) == 8866452693264111234
    assert wire_hash(second) == 807986237951177663
    assert hash_block_sha256_cbor(none_hash(), range(1, 17)) == first
    assert hash_blocks_sha256_cbor(list(range(17, 33)), 16, parent=first) == [second]
    assert second.hex() == BLOCK1_HEX
    assert spec_chain(None, None) == (first, second)


def test_partial_last_block_is_not_hashed() -> None:
    assert len(hash_blocks_sha256_cbor(list(range(40)), 16)) == 2


@pytest.fixture
def default_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.mark.usefixtures("default_seed")
def test_cache_salt_vector_tags_block_0_only() -> None:
    salted = hash_blocks_sha256_cbor(list(range(1, 33)), 16, cache_salt=SALT)
    assert tuple(d.hex() for d in salted) == SALTED_HEX
    # Block 0's CBOR written out byte by byte: array(3), bytes(32) parent, array(16) of
    # the tokens 1..16, then the extra keys: array(1) of array(2) "cache_salt", "tenant-a".
    raw = (
        b"\x83\x58\x20" + bytes.fromhex(NONE_HASH_HEX) + b"\x90" + bytes(range(1, 17))
        + b"\x81\x82\x6acache_salt\x68tenant-a"
    )  # fmt: skip
    assert hashlib.sha256(raw).hexdigest() == SALTED_HEX[0]
    # Block 1 has no extra keys: it differs from the plain chain only through its parent.
    assert spec_chain([["cache_salt", SALT]], None) == tuple(salted)
    assert [wire_hash(d) for d in salted] == [5068484237151326159, 15118032441609678279]


@pytest.mark.usefixtures("default_seed")
def test_lora_vector_tags_every_block_with_name_and_path() -> None:
    lora = hash_blocks_sha256_cbor(list(range(1, 33)), 16, lora=LORA)
    assert tuple(d.hex() for d in lora) == LORA_HEX
    entry = ["lora", "sql-adapter", "/adapters/sql"]
    assert spec_chain([entry], [entry]) == tuple(lora)
    assert [wire_hash(d) for d in lora] == [6235812900042262709, 8854044893280796132]
    # The path is part of the hash: the same adapter name from another path differs.
    moved = LoraAdapter(name="sql-adapter", int_id=7, path="/elsewhere/sql")
    assert hash_blocks_sha256_cbor(list(range(1, 17)), 16, lora=moved)[0] != lora[0]
    # The int id is not: it only travels in events.
    renumbered = LoraAdapter(name="sql-adapter", int_id=8, path="/adapters/sql")
    assert hash_blocks_sha256_cbor(list(range(1, 33)), 16, lora=renumbered) == lora


@pytest.mark.usefixtures("default_seed")
def test_lora_and_salt_vector_puts_lora_first() -> None:
    both = hash_blocks_sha256_cbor(list(range(1, 33)), 16, lora=LORA, cache_salt=SALT)
    assert tuple(d.hex() for d in both) == LORA_SALTED_HEX
    entry = ["lora", "sql-adapter", "/adapters/sql"]
    assert spec_chain([entry, ["cache_salt", SALT]], [entry]) == tuple(both)
    assert [wire_hash(d) for d in both] == [14092093597078032933, 6008205350856969516]
    assert len({BLOCK0_HEX, SALTED_HEX[0], LORA_HEX[0], LORA_SALTED_HEX[0]}) == 4


@pytest.mark.usefixtures("default_seed")
def test_salt_applies_to_block_0_of_the_request_only_and_not_when_empty() -> None:
    tokens = list(range(1, 33))
    plain = hash_blocks_sha256_cbor(tokens, 16)
    # A salt given for a block that is not block 0 of its request is ignored.
    assert hash_blocks_sha256_cbor(tokens[16:], 16, parent=plain[0], cache_salt=SALT,
                                   start_block=1) == [plain[1]]  # fmt: skip
    # vLLM adds the salt entry only for a non-empty salt.
    assert hash_blocks_sha256_cbor(tokens, 16, cache_salt="") == plain


def test_extra_keys_tagged_for_the_hash_untagged_for_events() -> None:
    keys = RequestExtraKeys.of(LORA, SALT)
    lora_entry = ("lora", "sql-adapter", "/adapters/sql")
    assert keys.hash_keys(0) == (lora_entry, ("cache_salt", SALT))
    assert keys.hash_keys(1) == keys.hash_keys(5) == (lora_entry,)
    assert keys.event_keys(0, 3) == [("sql-adapter", SALT), ("sql-adapter",), ("sql-adapter",)]
    assert keys.event_keys(2, 4) == [("sql-adapter",), ("sql-adapter",)]
    assert RequestExtraKeys.of(cache_salt=SALT).event_keys(0, 2) == [(SALT,), None]
    assert RequestExtraKeys.of().event_keys(0, 2) == [None, None]
    assert RequestExtraKeys.of(cache_salt="") is RequestExtraKeys.of()
    # A multimodal entry keeps every element after its tag.
    assert untagged((lora_entry, ("mm", "img-1", 3), ("cache_salt", "s"))) == (
        "sql-adapter", ("img-1", 3), "s",
    )  # fmt: skip


@pytest.mark.parametrize(
    "fields",
    [
        {"name": "", "int_id": 1, "path": "/p"},
        {"name": 3, "int_id": 1, "path": "/p"},
        {"name": "a", "int_id": 0, "path": "/p"},
        {"name": "a", "int_id": True, "path": "/p"},
        {"name": "a", "int_id": "1", "path": "/p"},
        {"name": "a", "int_id": 1, "path": None},
    ],
)
def test_lora_adapter_rejects_bad_fields(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="LoRA adapter"):
        LoraAdapter(**fields)


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
    # An empty salt is no salt, as for the engine, which hashes nothing for it.
    assert keyer.keys(tokens, 16, cache_salt="") == keyer.keys(tokens, 16)
    assert root_key(3, "a", "") == root_key(3, "a")


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_router_keys_reject_tokens_outside_uint32(bad: list[int]) -> None:
    with pytest.raises(OverflowError):
        router_block_keys(bad * 16, 16, 0)


@pytest.mark.slow
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


@pytest.mark.slow
@given(
    parent=st.binary(min_size=32, max_size=32) | st.binary(max_size=40),
    tokens=st.lists(st.integers(0, 2**40), max_size=40),
    extra=st.none()
    | st.tuples(st.tuples(st.just("lora"), st.text(), st.text()))
    | st.tuples(st.tuples(st.just("cache_salt"), st.text(max_size=5)), st.tuples(st.text())),
)
def test_fast_cbor_path_equals_canonical_cbor(
    parent: bytes, tokens: list[int], extra: tuple[tuple[Any, ...], ...] | None
) -> None:
    expected = hashlib.sha256(cbor2.dumps([parent, tokens, extra], canonical=True)).digest()
    assert hash_block_sha256_cbor(parent, tokens, extra) == expected
