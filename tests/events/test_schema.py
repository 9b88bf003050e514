"""Wire schema: golden bytes in vLLM 0.33's map shape, tolerant decoding of both shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from events.errors import EventDecodeError
from events.schema import (
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

GOLDEN = Path(__file__).parent / "golden"
H = 0xFFEEDDCCBBAA9988  # an unsigned 64-bit hash above 2**63

STORED = BlockStored(
    block_hashes=[18441921395520346504, 1234],
    parent_block_hash=None,
    token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
    block_size=4,
    lora_id=None,
    medium="GPU",
    lora_name=None,
    extra_keys=[None, None],
    group_idx=0,
)
# What a kvroute worker sends: the example's BlockStored plus the spec kind that the KV
# cache manager stamps on it, as vLLM 0.33's does.
WORKER_STORED = msgspec.structs.replace(STORED, kv_cache_spec_kind="full_attention")
REMOVED = BlockRemoved(block_hashes=[1234], medium="GPU", group_idx=0)
TS = 1700000000.5


def golden(name: str) -> bytes:
    return bytes.fromhex((GOLDEN / f"{name}.hex").read_text().strip())


@pytest.mark.parametrize(
    ("name", "batch"),
    [
        ("vllm_wire_example_map", KVEventBatch(TS, [STORED, REMOVED, AllBlocksCleared()], 0)),
        ("block_stored_map", KVEventBatch(TS, [WORKER_STORED], 0)),
        ("block_removed_map", KVEventBatch(TS, [REMOVED], 0)),
        ("all_blocks_cleared_map", KVEventBatch(TS, [AllBlocksCleared()], None)),
    ],
)
def test_encode_matches_golden_bytes_and_round_trips(name: str, batch: KVEventBatch) -> None:
    assert encode_batch(batch) == golden(name)
    assert decode_batch(golden(name)) == batch


def test_map_shape_is_the_vllm_wire_example() -> None:
    raw = msgspec.msgpack.decode(golden("vllm_wire_example_map"))
    assert raw == [
        TS,
        [
            {
                "type": "BlockStored",
                "block_hashes": [18441921395520346504, 1234],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None, None],
                "group_idx": 0,
            },
            {"type": "BlockRemoved", "block_hashes": [1234], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    # Field order on the wire is declaration order, as vLLM's strict decoders expect.
    assert list(raw[1][0]) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
        "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
    ]  # fmt: skip


def test_worker_block_stored_golden_ends_with_the_spec_kind() -> None:
    (event,) = msgspec.msgpack.decode(golden("block_stored_map"))[1]
    assert list(event.items())[-2:] == [("group_idx", 0), ("kv_cache_spec_kind", "full_attention")]
    assert "kv_cache_spec_sliding_window" not in event  # None: omitted


def test_decodes_legacy_array_shape_golden() -> None:
    batch = decode_batch(golden("vllm_wire_example_legacy_array"))
    assert batch == KVEventBatch(
        1.5,
        [
            BlockStored(
                block_hashes=[H],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved(block_hashes=[H], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        0,
    )


def enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_legacy_shape_tolerates_missing_and_extra_fields() -> None:
    old = enc([2.0, [["BlockStored", [-7], b"\x01" * 32, [1, 2], 2], ["BlockRemoved", [5]]]])
    batch = decode_batch(old)
    assert batch.data_parallel_rank is None
    stored, removed = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [-7]
    assert stored.parent_block_hash == b"\x01" * 32
    assert (stored.lora_id, stored.medium, stored.lora_name, stored.extra_keys) == (None,) * 4
    assert removed == BlockRemoved(block_hashes=[5], medium=None)
    newer = ["BlockRemoved", [5], "CPU", 1, "loc", "own", "a-future-field", 42]
    assert decode_batch(enc([2.0, [newer]])).events == [
        BlockRemoved(block_hashes=[5], medium="CPU", group_idx=1, locality="loc", ownership="own")
    ]


def test_map_shape_ignores_unknown_keys_and_accepts_missing_nullable_fields() -> None:
    event = {"type": "BlockStored", "block_hashes": [b"\xaa" * 32], "parent_block_hash": 9,
             "token_ids": [1], "block_size": 1, "brand_new_field": {"x": 1}}  # fmt: skip
    (stored,) = decode_batch(enc([3.0, [event], 2])).events
    assert stored == BlockStored([b"\xaa" * 32], 9, [1], 1, None, None, None)


@pytest.mark.parametrize("value", [0, 2**64 - 1, -(2**63), b"\x00" * 16, b"\xff" * 32])
def test_every_wire_hash_form_survives(value: int | bytes) -> None:
    batch = KVEventBatch(1.0, [BlockRemoved([value], "GPU")], None)
    assert decode_batch(encode_batch(batch)).events[0] == BlockRemoved([value], "GPU")


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "msgpack"),
        (b"", "msgpack"),
        (enc({"ts": 1}), "bad_batch"),
        (enc([1.0]), "bad_batch"),
        (enc(["x", []]), "bad_batch"),
        (enc([1.0, [], "rank"]), "bad_batch"),
        (enc([1.0, "events"]), "bad_batch"),
        (enc([1.0, [{"type": "BlockEvicted"}]]), "unknown_tag"),
        (enc([1.0, [["Nope", 1]]]), "unknown_tag"),
        (enc([1.0, [{"block_hashes": [1]}]]), "unknown_tag"),
        (enc([1.0, [42]]), "bad_event"),
        (enc([1.0, [[]]]), "bad_event"),
        (enc([1.0, [{"type": "BlockRemoved", "block_hashes": "x", "medium": None}]]), "bad_field"),
        (enc([1.0, [["BlockStored", [1], None, ["a"], 4]]]), "bad_field"),
        (enc([1.0, [["BlockStored", [1], None, [1]]]]), "bad_field"),
        (enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5], "medium": 1}]]), "bad_field"),
    ],
)
def test_malformed_payloads_raise_a_counted_decode_error(payload: bytes, reason: str) -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_batch(payload)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError)


def test_oversized_payload_is_rejected_before_decoding() -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_batch(memoryview(bytearray(MAX_PAYLOAD_BYTES + 1)))
    assert info.value.reason == "too_large"


def test_unknown_events_can_be_skipped_and_reported_keeping_the_rest() -> None:
    payload = enc([1.0, [{"type": "BlockTiered", "x": 1}, ["BlockRemoved", [5], "GPU"]], 0])
    seen: list[str] = []
    batch = decode_batch(payload, seen.append)
    assert batch.events == [BlockRemoved([5], "GPU")]
    assert len(seen) == 1
    assert "BlockTiered" in seen[0]
