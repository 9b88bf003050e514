"""Hypothesis strategies for KV event batches and their payloads, valid and mutated.

Valid batches cover every event type and every field vLLM sends (optional ones present or
absent, int and bytes hashes, LoRA ids and names, per-block extra keys with a LoRA name,
multimodal pairs and a cache salt, KV cache groups and spec fields, values of the fields
typed ``Any``), in the map shape (``encode_batch``) and the legacy array shape. Mutants
damage valid payloads at the byte level and at the object level. Used by the decoder
fuzz tests and the C decoder's parity tests.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch

__all__ = [
    "any_payload",
    "batches",
    "byte_mutants",
    "events",
    "hashes",
    "legacy_payload",
    "object_mutants",
    "odd_values",
    "removed",
    "small_hashes",
    "stored",
    "valid_payloads",
    "wire_values",
]

hashes = st.one_of(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=-(2**63), max_value=-1),  # pre-0.10.2 engines: Python hash()
    st.binary(min_size=16, max_size=32),
)
small_hashes = st.integers(min_value=0, max_value=7)  # collide often: parents, duplicates
media = st.sampled_from(["GPU", "CPU", "STORAGE", None])
lora_names = st.none() | st.sampled_from(["a", "b", "sql-lora"])
# Every msgpack int width, and the edges of uint32 (token ids).
wide_ints = st.one_of(
    st.integers(min_value=0, max_value=300),
    st.sampled_from([2**8, 2**16 - 1, 2**16, 2**31, 2**32 - 1]),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
)
wire_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=6),
        st.binary(max_size=6),
    ),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
"""Values a field typed ``Any`` may hold (what msgpack round-trips unchanged)."""


@st.composite
def _block_extra_keys(draw: st.DrawFn, lora_name: str | None, first: bool) -> list[Any] | None:
    """One block's untagged extra keys as vLLM publishes them: the LoRA name, multimodal
    ``[id, offset]`` pairs, the cache salt on block 0, a prompt-embeddings digest."""
    keys: list[Any] = [] if lora_name is None else [lora_name]
    keys += draw(st.lists(st.tuples(st.text(max_size=6), st.integers(0, 99)).map(list), max_size=2))
    if first and draw(st.booleans()):
        keys.append(draw(st.text(min_size=1, max_size=8)))
    if draw(st.booleans()):
        keys.append(draw(st.binary(min_size=4, max_size=8)))
    return keys or None


@st.composite
def stored(
    draw: st.DrawFn,
    hash_values: st.SearchStrategy[Any] = hashes,
    token_values: st.SearchStrategy[int] | None = None,
) -> BlockStored:
    """A ``BlockStored`` with every field drawn (the optional ones present or not)."""
    block_size = draw(st.integers(min_value=1, max_value=4))
    block_hashes = draw(st.lists(hash_values, min_size=1, max_size=4))
    num_tokens = block_size * len(block_hashes)
    tokens = draw(
        st.lists(
            st.integers(min_value=0, max_value=50) if token_values is None else token_values,
            min_size=num_tokens,
            max_size=num_tokens,
        )
    )
    parent = draw(st.none() | hash_values)
    lora_name = draw(lora_names)
    extra_keys = None
    if draw(st.booleans()):
        extra_keys = [
            draw(_block_extra_keys(lora_name, first=parent is None and i == 0))
            for i in range(len(block_hashes))
        ]
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=None if lora_name is None else draw(st.integers(1, 2**31)),
        medium=draw(media),
        lora_name=lora_name,
        extra_keys=extra_keys,
        group_idx=draw(st.none() | st.integers(min_value=0, max_value=1)),
        kv_cache_spec_kind=draw(st.none() | st.sampled_from(["full_attention", "sliding"])),
        kv_cache_spec_sliding_window=draw(st.none() | st.integers(0, 4096)),
        locality=draw(st.none() | wire_values),
        ownership=draw(st.none() | wire_values),
        session_id=draw(st.none() | wire_values),
        lookahead_token_ids=draw(st.none() | st.lists(wide_ints, max_size=3)),
    )


def removed(hash_values: st.SearchStrategy[Any] = hashes) -> st.SearchStrategy[BlockRemoved]:
    return st.builds(
        BlockRemoved,
        block_hashes=st.lists(hash_values, min_size=1, max_size=4),
        medium=media,
        group_idx=st.none() | st.integers(min_value=0, max_value=1),
        locality=st.none() | wire_values,
        ownership=st.none() | wire_values,
    )


def events(
    hash_values: st.SearchStrategy[Any] = hashes,
    token_values: st.SearchStrategy[int] | None = None,
) -> st.SearchStrategy[Any]:
    return st.one_of(
        stored(hash_values, token_values), removed(hash_values), st.just(AllBlocksCleared())
    )


def batches(
    hash_values: st.SearchStrategy[Any] = hashes,
    token_values: st.SearchStrategy[int] | None = None,
) -> st.SearchStrategy[KVEventBatch]:
    return st.builds(
        KVEventBatch,
        ts=st.floats(allow_nan=False, allow_infinity=False, width=64),
        events=st.lists(events(hash_values, token_values), max_size=5),
        data_parallel_rank=st.none() | st.integers(min_value=0, max_value=7),
    )


def legacy_payload(batch: KVEventBatch) -> bytes:
    """The legacy array shape: every event ``[tag, field1, ...]`` with all fields."""
    raw: list[Any] = []
    for event in batch.events:
        fields = [getattr(event, name) for name in type(event).__struct_fields__]
        raw.append([type(event).__name__, *fields])
    return msgspec.msgpack.encode([batch.ts, raw, batch.data_parallel_rank])


@st.composite
def valid_payloads(draw: st.DrawFn) -> bytes:
    batch = draw(batches())
    return legacy_payload(batch) if draw(st.booleans()) else encode_batch(batch)


@st.composite
def byte_mutants(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(valid_payloads()))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "splice"]))
        pos = draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(min_value=1, max_value=8))]
        else:
            data[pos:pos] = draw(valid_payloads())[: draw(st.integers(0, 16))]
    return bytes(data)


odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**64 - 1), max_size=2),
)


@st.composite
def object_mutants(draw: st.DrawFn) -> bytes:
    """A valid batch decoded to plain objects, one part replaced, re-encoded."""
    raw = msgspec.msgpack.decode(draw(valid_payloads()))
    target = draw(st.sampled_from(["batch", "ts", "rank", "event", "field", "tag", "extra"]))
    event_list = raw[1]
    if target == "batch":
        raw = draw(odd_values)
    elif target == "ts":
        raw[0] = draw(odd_values)
    elif target == "rank":
        raw.append(draw(odd_values)) if len(raw) < 3 else raw.__setitem__(2, draw(odd_values))
    elif not event_list:
        raw[1] = draw(odd_values)
    else:
        i = draw(st.integers(min_value=0, max_value=len(event_list) - 1))
        event = event_list[i]
        if target == "event":
            event_list[i] = draw(odd_values)
        elif isinstance(event, dict):
            keys = sorted(event)
            key = draw(st.sampled_from(keys))
            if target == "field":
                event[key] = draw(odd_values)
            elif target == "tag":
                event["type"] = draw(odd_values | st.sampled_from(["Future", "blockstored"]))
            elif draw(st.booleans()):
                event[draw(st.text(max_size=6))] = draw(odd_values)
            else:
                del event[key]
        else:
            pos = draw(st.integers(min_value=0, max_value=len(event) - 1))
            if target == "extra":
                event.append(draw(odd_values))
            else:
                event[pos] = draw(odd_values)
    return msgspec.msgpack.encode(raw)


any_payload = st.one_of(st.binary(max_size=256), byte_mutants(), object_mutants())
