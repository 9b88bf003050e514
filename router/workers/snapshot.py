"""A kvroute worker's ``GET /v1/snapshot``: its JSON shape, fetching it, and it as events.

The snapshot lists every cached block as unbranched runs, parents first, each shaped
like a ``BlockStored`` event, and reflects exactly the event batches with
``seq < next_seq``: applying it and then the live stream from ``next_seq`` rebuilds a
worker's entries without replaying its history.
"""

from __future__ import annotations

from typing import Final

import aiohttp
import msgspec

from events.identity import WorkerId
from events.schema import BlockStored
from router.errors import PrefixIndexError

__all__ = ["Snapshot", "SnapshotRun", "fetch_snapshot", "snapshot_events"]

_SNAPSHOT_PATH: Final = "/v1/snapshot"


class SnapshotRun(msgspec.Struct):
    """One unbranched run of cached blocks, shaped like a ``BlockStored``."""

    parent_block_hash: int | None
    block_hashes: list[int]
    token_ids: list[int]


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
    """The snapshot's runs as ``BlockStored`` events, parents first."""
    return [
        BlockStored(
            block_hashes=list(run.block_hashes),
            parent_block_hash=run.parent_block_hash,
            token_ids=run.token_ids,
            block_size=snapshot.block_size,
            lora_id=None,
            medium=snapshot.medium,
            lora_name=lora_name,
        )
        for run in snapshot.runs
    ]


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
