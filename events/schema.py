"""KV cache event wire schema: msgspec structs compatible with vLLM's KV events.

Encoding produces vLLM 0.33's shape: the batch is a positional array
``[ts, events, data_parallel_rank]`` and each event a map whose ``"type"`` key holds the
class name, fields in declaration order, optional fields omitted when ``None``.
Decoding accepts that shape and the legacy one (each event a positional array
``[tag, field1, ...]``), ignoring unknown map keys and extra trailing array elements and
treating absent fields as ``None``. Anything else raises :class:`EventDecodeError`.

:func:`python_decode_batch` is that decoder, the spec. Where the C module ``events._wire``
was built, :func:`decode_batch` reads the common shape (what vLLM >= 0.33 and kvroute send)
in C first, straight from the bytes, and gives the rest to the spec: the same batch, except
that a ``BlockStored``'s ``token_ids`` is then a ``TokenIds`` (native uint32s packed in one
object, equal to the list of the same ints; :func:`events.hashing.router_block_keys` hashes
it without reading an int).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias, cast

import msgspec

from events.errors import EventDecodeError
from events.native import native

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "NATIVE_DECODE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
    "WireHash",
    "decode_batch",
    "encode_batch",
    "python_decode_batch",
]

WireHash: TypeAlias = int | bytes
"""A block hash as it travels: a 64-bit int (signed or unsigned) or raw digest bytes."""

MAX_PAYLOAD_BYTES: Final = 64 * 1024 * 1024
"""Payloads above this size are rejected before decoding (``reason="too_large"``)."""


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the tagged KV cache events; the tag is the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """A run of consecutive blocks of one request became full and was cached.

    NOTE: ``token_ids`` holds ``len(block_hashes) * block_size`` tokens, the blocks'
    tokens concatenated (a list, or a ``TokenIds`` from the C decoder: read it as a
    sequence); ``parent_block_hash`` is the hash of the block before the first one,
    ``None`` when the run starts at block 0.
    """

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted (one entry per evicted physical copy)."""

    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset; no ``BlockRemoved`` accompanies it."""


AnyEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """The events one engine step produced, in order.

    Attributes:
        ts: Wall-clock time in seconds when the batch was made.
        events: The events, in emission order.
        data_parallel_rank: The data-parallel rank of the engine, or ``None``.
    """

    ts: float
    events: list[AnyEvent]
    data_parallel_rank: int | None = None


_EVENT_TYPES: Final[dict[str, type[KVCacheEvent]]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
# Positional field names of each event in the legacy array shape (after the tag).
_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    name: cls.__struct_fields__ for name, cls in _EVENT_TYPES.items()
}
# Fields that vLLM declares without a default but that may be absent from old senders.
_NULLABLE: Final[dict[str, dict[str, None]]] = {
    "BlockStored": {"lora_id": None, "medium": None, "lora_name": None},
    "BlockRemoved": {"medium": None},
    "AllBlocksCleared": {},
}

_TokenIds: Final[Any] = native("events._wire", "TokenIds")  # None where not built


def _encode_other(value: Any) -> Any:
    """Token ids held as ``TokenIds`` (a decoded batch sent on) encode as their list."""
    if type(value) is not _TokenIds:
        # What msgspec raises without a hook.
        raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")
    return value.tolist()


_encoder: Final = msgspec.msgpack.Encoder(enc_hook=_encode_other)
_raw_decoder: Final = msgspec.msgpack.Decoder()
_fast_decoder: Final = msgspec.msgpack.Decoder(KVEventBatch)

_NativeDecode: TypeAlias = Callable[[bytes | memoryview], KVEventBatch | None]


def _bind_native() -> _NativeDecode | None:
    """The C decoder, told the classes it builds, where ``events._wire`` is used; else None."""
    bind = native("events._wire", "bind")
    if bind is None:
        return None
    bind(KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared, _raw_decoder.decode)
    Sequence.register(_TokenIds)
    return cast("_NativeDecode", native("events._wire", "decode"))


_native_decode: Final = _bind_native()
NATIVE_DECODE: Final = _native_decode is not None
"""Whether :func:`decode_batch` reads the common shape in C (``events._wire``)."""


def encode_batch(batch: KVEventBatch) -> bytes:
    """Encode a batch in vLLM 0.33's wire shape (array batch, map-encoded events)."""
    return _encoder.encode(batch)


def decode_batch(
    payload: bytes | memoryview, on_unknown: Callable[[str], None] | None = None
) -> KVEventBatch:
    """Decode a msgpack batch payload in either the map or the legacy array shape.

    Where ``events._wire`` was built, the common shape is read in C and the rest by
    :func:`python_decode_batch`: the same batches and the same errors as that function
    alone, ``token_ids`` aside (see the module docstring).

    Args:
        payload: The third frame of a KV event message.
        on_unknown: As for :func:`python_decode_batch`.

    Returns:
        The decoded batch; absent optional fields are ``None``.

    Raises:
        EventDecodeError: As :func:`python_decode_batch`.
    """
    if _native_decode is not None and len(payload) <= MAX_PAYLOAD_BYTES:
        batch = _native_decode(payload)
        if batch is not None:
            return batch
    return python_decode_batch(payload, on_unknown)


def python_decode_batch(
    payload: bytes | memoryview, on_unknown: Callable[[str], None] | None = None
) -> KVEventBatch:
    """Decode a msgpack batch payload in either the map or the legacy array shape: the
    spec of :func:`decode_batch`, and what it runs where ``events._wire`` was not built.

    Args:
        payload: The third frame of a KV event message.
        on_unknown: Called with a description of each event whose tag is unknown (an
            event type newer than this code); such events are skipped and the rest of the
            batch is kept. ``None`` makes an unknown tag an error.

    Returns:
        The decoded batch; absent optional fields are ``None``.

    Raises:
        EventDecodeError: The payload is too large, not msgpack, not a batch, holds an
            unknown event tag (without ``on_unknown``), or a field has the wrong type.
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise EventDecodeError(
            "too_large", f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}"
        )
    try:
        # Fast path: a well-formed map-shaped batch from vLLM >= 0.33 or kvroute.
        return _fast_decoder.decode(payload)
    except msgspec.DecodeError:
        pass
    try:
        raw = _raw_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError("msgpack", f"payload is not valid msgpack ({exc})") from exc
    return _batch_from_raw(raw, on_unknown)


def _batch_from_raw(raw: Any, on_unknown: Callable[[str], None] | None) -> KVEventBatch:
    if not isinstance(raw, (list, tuple)) or len(raw) < 2:
        raise EventDecodeError(
            "bad_batch", f"expected an array [ts, events, dp_rank?], got {_describe(raw)}"
        )
    ts, raw_events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise EventDecodeError("bad_batch", f"batch ts must be a number, got {_describe(ts)}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise EventDecodeError(
            "bad_batch", f"data_parallel_rank must be an int or nil, got {_describe(rank)}"
        )
    if not isinstance(raw_events, (list, tuple)):
        raise EventDecodeError(
            "bad_batch", f"batch events must be an array, got {_describe(raw_events)}"
        )
    events: list[KVCacheEvent] = []
    for item in raw_events:
        try:
            events.append(_event_from_raw(item))
        except EventDecodeError as exc:
            if exc.reason != "unknown_tag" or on_unknown is None:
                raise
            on_unknown(str(exc))
    return KVEventBatch(ts=float(ts), events=events, data_parallel_rank=rank)  # type: ignore[arg-type]


def _event_from_raw(item: Any) -> KVCacheEvent:
    if isinstance(item, dict):
        tag = item.get("type")
        fields = {k: v for k, v in item.items() if k != "type"}
    elif isinstance(item, (list, tuple)) and item:
        tag = item[0]
        names = _FIELDS.get(tag, ()) if isinstance(tag, str) else ()
        # Extra trailing elements (fields newer than ours) are ignored.
        fields = dict(zip(names, item[1:], strict=False))
    else:
        raise EventDecodeError("bad_event", f"expected a map or array event, got {_describe(item)}")
    if not isinstance(tag, str) or tag not in _EVENT_TYPES:
        raise EventDecodeError("unknown_tag", f"unknown event tag {tag!r}")
    cls = _EVENT_TYPES[tag]
    known = _FIELDS[tag]
    kwargs: dict[str, Any] = dict(_NULLABLE[tag])
    kwargs.update((k, v) for k, v in fields.items() if k in known)
    return _convert(cls, kwargs)


def _convert(cls: type[KVCacheEvent], kwargs: dict[str, Any]) -> KVCacheEvent:
    try:
        return msgspec.convert(kwargs, cls)
    except msgspec.ValidationError as exc:
        raise EventDecodeError("bad_field", f"{cls.__name__}: {exc}") from exc


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
