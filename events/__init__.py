"""kvroute events: the vLLM-compatible KV event wire schema, hashing, framing and streaming."""

from events.auth import AuthKeyError, BearerKey, KeySpec, load_key
from events.curve import CurveClientConfig, CurveKeyPair, CurveServerConfig
from events.endpoints import Endpoint
from events.errors import EventDecodeError, EventsError, FramingError
from events.extra_keys import LoraAdapter, RequestExtraKeys
from events.framing import make_message, pack_seq, parse_message, unpack_seq
from events.hashing import (
    BlockHash,
    BlockKey,
    RouterKeyer,
    hash_block_sha256_cbor,
    hash_blocks_sha256_cbor,
    none_hash,
    root_key,
    router_block_key,
    router_block_keys,
    wire_hash,
)
from events.publisher import EventPublisher, PublisherConfig
from events.recorder import EventLogWriter, EventRecorder, LogRecord, read_log
from events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from events.subscriber import (
    EventSink,
    EventSubscriber,
    ReceivedBatch,
    SubscriberConfig,
    WorkerCounters,
    WorkerStream,
)
from events.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "AllBlocksCleared",
    "AuthKeyError",
    "BearerKey",
    "BlockHash",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "ByteTokenizer",
    "CurveClientConfig",
    "CurveKeyPair",
    "CurveServerConfig",
    "Endpoint",
    "EventDecodeError",
    "EventLogWriter",
    "EventPublisher",
    "EventRecorder",
    "EventSink",
    "EventSubscriber",
    "EventsError",
    "FramingError",
    "KVCacheEvent",
    "KVEventBatch",
    "KeySpec",
    "LogRecord",
    "LoraAdapter",
    "PublisherConfig",
    "ReceivedBatch",
    "RequestExtraKeys",
    "RouterKeyer",
    "SubscriberConfig",
    "Tokenizer",
    "TokenizerError",
    "WorkerCounters",
    "WorkerStream",
    "decode_batch",
    "encode_batch",
    "hash_block_sha256_cbor",
    "hash_blocks_sha256_cbor",
    "load_key",
    "load_tokenizer",
    "make_message",
    "none_hash",
    "pack_seq",
    "parse_message",
    "read_log",
    "root_key",
    "router_block_key",
    "router_block_keys",
    "unpack_seq",
    "wire_hash",
]
