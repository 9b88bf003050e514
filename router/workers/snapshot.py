"""A kvroute worker's ``GET /v1/snapshot``: its JSON shape, fetching it, and it as events.

The snapshot lists every cached block as unbranched runs, parents first, each shaped
like a ``BlockStored`` event, and reflects exactly the event batches with
``seq < next_seq``: applying it and then the live stream from ``next_seq`` rebuilds a
worker's entries without replaying its history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import aiohttp
import msgspec

from events.identity import WorkerId
from events.schema import BlockStored, WireHash
from router.errors import PrefixIndexError

__all__ = ["Snapshot", "SnapshotRun", "fetch_snapshot", "snapshot_events"]

_SNAPSHOT_PATH: Final = "/v1/snapshot"


class SnapshotRun(msgspec.Struct):
    """One unbranched run of cached blocks, shaped like a ``BlockStored``.

    ``copies``: physical copies per block (None: one each); a worker that caches a block
    twice removes it twice, so the index must count both."""

    parent_block_hash: int | None
    block_hashes: list[int]
    token_ids: list[int]
    copies: list[int] | None = None


class Snapshot(msgspec.Struct):
    """A kvroute worker's ``GET /v1/snapshot``: every cached block, parent-first runs.

    NOTE: it reflects exactly the event batches with ``seq < next_seq``.
    """

    block_size: int
    runs: list[SnapshotRun]
    next_seq: int = 0
    medium: str | None = "GPU"
    worker_id: WorkerId | None = None


def snapshot_events(snapshot: Snapshot, lora_name: str | None = None) -> list[BlockStored]:
    """The snapshot's runs as ``BlockStored`` events, parents first; each further copy of
    a block is one more single-block ``BlockStored`` after its run (as the worker
    announced it when it cached that copy)."""

    def stored(parent: int | None, hashes: Sequence[int], tokens: list[int]) -> BlockStored:
        block_hashes: list[WireHash] = list(hashes)
        return BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=snapshot.block_size,
            lora_id=None,
            medium=snapshot.medium,
            lora_name=lora_name,
        )

    size = snapshot.block_size
    events: list[BlockStored] = []
    for run in snapshot.runs:
        events.append(stored(run.parent_block_hash, run.block_hashes, run.token_ids))
        if run.copies is None:
            continue
        parents = [run.parent_block_hash, *run.block_hashes[:-1]]
        for i, (parent, block_hash, count) in enumerate(
            zip(parents, run.block_hashes, run.copies, strict=False)
        ):
            tokens = run.token_ids[i * size : (i + 1) * size]
            events.extend(stored(parent, [block_hash], tokens) for _ in range(count - 1))
    return events


async def fetch_snapshot(
    session: aiohttp.ClientSession, http_url: str, timeout_s: float = 10.0
) -> Snapshot:
    """GET a kvroute worker's snapshot.

    Raises:
        PrefixIndexError: The request failed, timed out or returned an unexpected body.
    """
    url = http_url.rstrip("/") + _SNAPSHOT_PATH
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(url, timeout=timeout) as response:
            body = await response.read()
            if response.status != 200:
                raise PrefixIndexError(f"GET {url}: HTTP {response.status}: {body[:200]!r}")
        return msgspec.json.decode(body, type=Snapshot)
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
        raise PrefixIndexError(f"GET {url} failed: {exc}") from exc
