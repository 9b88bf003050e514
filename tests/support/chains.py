"""Token chains as real engine events: sha256_cbor block hashes, one BlockStored per run."""

from __future__ import annotations

from events.hashing import hash_blocks_sha256_cbor, wire_hash
from events.schema import BlockStored

BS = 16  # the router's block size: that of its first registered worker (default 16)


def stored(tokens: list[int], first: int, last: int, medium: str = "GPU") -> BlockStored:
    """Blocks ``first..last-1`` of the chain of ``tokens`` as one event."""
    hashes: list[int | bytes] = [wire_hash(h) for h in hash_blocks_sha256_cbor(tokens, BS)]
    return BlockStored(
        block_hashes=hashes[first:last],
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=list(tokens[first * BS : last * BS]),
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )
