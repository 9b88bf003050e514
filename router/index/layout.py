"""Redis key naming of the prefix index: every key under ``kvroute:<ns>:`` with cluster hash tags.

Keys that one server-side script touches together share a hash tag, so each script runs
on one Redis Cluster shard:

* block entries of a prefix family (``{<tag>}``: the router key of the chain's block 0),
  so a lookup walking one request's chain is one round trip;
* a worker's lease, state hash and membership set (``{w:<worker>}``), so the fencing
  check and the membership update are one atomic script.

``<ns>`` is *not* a hash tag: namespaces keep clusters and tests apart, tags spread
families over shards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from events.hashing import BlockKey
from router.errors import PrefixIndexError
from router.index.base import WorkerId

__all__ = ["MEMBER_BYTES", "KeyLayout", "check_name", "pack_member", "unpack_member"]

_NAME: Final = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
MEMBER_BYTES: Final = 24


def check_name(kind: str, value: str) -> str:
    """Validate a namespace or worker id for use inside key names.

    Raises:
        PrefixIndexError: The value is empty, longer than 128 characters, or holds a
            character other than letters, digits and ``_.:@-`` (braces would break
            cluster hash tags).
    """
    if not _NAME.fullmatch(value):
        raise PrefixIndexError(
            f"{kind} {value!r} is not valid: use 1-128 characters from [A-Za-z0-9_.:@-]"
        )
    return value


def pack_member(tag: BlockKey, key: BlockKey) -> bytes:
    """A block's id in its worker's membership set: the tag as 16 hex digits, the key as
    8 bytes big-endian (the Lua scripts cut block key names out of it)."""
    return b"%016x" % tag + key.to_bytes(8, "big")


def unpack_member(member: bytes) -> tuple[BlockKey, BlockKey]:
    """Inverse of :func:`pack_member`.

    Raises:
        PrefixIndexError: The member is not 24 bytes (the set was written by something else).
    """
    if len(member) != MEMBER_BYTES:
        raise PrefixIndexError(f"membership entry must be {MEMBER_BYTES} bytes, got {len(member)}")
    try:
        tag = int(member[:16], 16)
    except ValueError:
        raise PrefixIndexError(
            f"membership entry {member!r} does not start with a hex tag"
        ) from None
    return BlockKey(tag), BlockKey(int.from_bytes(member[16:], "big"))


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """Key names of one namespace.

    Args:
        namespace: Cluster (or test) namespace; letters, digits and ``_.:@-``.
    """

    namespace: str = "default"

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)

    @property
    def prefix(self) -> str:
        """``kvroute:<ns>:``, the prefix of every key of the namespace."""
        return f"kvroute:{self.namespace}:"

    def block(self, tag: BlockKey, key: BlockKey) -> bytes:
        """Hash of one router key: field = worker id, value = tier mask.

        NOTE: the key part after the tag is 8 raw bytes to save memory; only the tag,
        which Redis Cluster hashes, must stay brace-free (hex).
        """
        return self.family_prefix(tag) + key.to_bytes(8, "big")

    def block_prefix(self) -> bytes:
        """What every block key starts with; the scripts append ``{tag}`` and the key."""
        return f"{self.prefix}b:".encode()

    def family_prefix(self, tag: BlockKey) -> bytes:
        """What every block key of one prefix family starts with (``...b:{<tag>}``)."""
        return f"{self.prefix}b:{{{tag:016x}}}".encode()

    def lease(self, worker_id: WorkerId) -> str:
        """String ``"<epoch>:<owner>"`` with a TTL: the worker's single-writer lease."""
        return f"{self.prefix}lease:{{w:{worker_id}}}"

    def worker(self, worker_id: WorkerId) -> str:
        """Hash of a worker's index state: ``epoch`` counter and ``entries`` count."""
        return f"{self.prefix}worker:{{w:{worker_id}}}"

    def members(self, worker_id: WorkerId) -> str:
        """Set of the worker's entries (:func:`pack_member` ids): O(its blocks) clears."""
        return f"{self.prefix}members:{{w:{worker_id}}}"

    @property
    def indexed(self) -> str:
        """Set of worker ids that may hold entries (what the reaper walks)."""
        return f"{self.prefix}indexed"

    @property
    def registry(self) -> str:
        """Hash worker id -> JSON registration (endpoints, kind, block size)."""
        return f"{self.prefix}registry"

    @property
    def stats(self) -> str:
        """Hash of namespace-wide counters (``keys``: distinct block keys)."""
        return f"{self.prefix}stats"
