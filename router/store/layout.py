"""Redis key naming of the prefix index: every key under ``kvroute:<ns>:`` with cluster hash tags.

A prefix family is the set of chains that share block 0; its tag is block 0's router key.
Per family and worker, the router keys the worker holds are two Redis sets (GPU tier,
CPU tier) of their decimals (63-bit, non-negative), which Redis stores as compact
*intsets* (8 bytes per key while a set holds at most ``set-max-intset-entries``, default
512). A
family's holders hash counts each worker's entries, so a lookup finds its candidates in
one command. Keys that one script touches together share a hash tag:

* a family's sets and holders hash (``{<tag>}``): a lookup is one script on one shard;
* a worker's lease, handoff, state hash and family list (``{w:<worker>}``): the fencing
  check and the bookkeeping are one atomic script.

``<ns>`` is *not* a hash tag: namespaces keep clusters and tests apart, tags spread
families over shards.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from events.hashing import BlockKey
from events.identity import WorkerId
from events.native import native
from router.errors import PrefixIndexError

__all__ = [
    "NAMESPACE_MARKERS",
    "KeyLayout",
    "check_name",
    "decode_key",
    "encode_keys_fixed",
    "namespace_of",
    "tag_text",
]

_NAME: Final = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
_KEY_LIMIT: Final = 1 << 63
_fixed_decimals: Final = native("router.store._resp", "fixed_decimals")


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


NAMESPACE_MARKERS: Final = ("indexed", "registry", "routers")
"""Key suffixes of which every namespace in use has at least one: a scan for
``kvroute:*:<marker>`` finds the namespaces of a server (see :func:`namespace_of`)."""


def namespace_of(key: str) -> str | None:
    """The namespace of a marker key ``kvroute:<ns>:<marker>``, else ``None``."""
    for marker in NAMESPACE_MARKERS:
        suffix = f":{marker}"
        if key.startswith("kvroute:") and key.endswith(suffix):
            namespace = key[len("kvroute:") : -len(suffix)]
            if _NAME.fullmatch(namespace):
                return namespace
    return None


def encode_keys_fixed(keys: Sequence[int]) -> bytes:
    """Router keys as decimals right-aligned in 20 characters each (no separator): a
    script can cut out key ``i`` without splitting the whole list. Formatted by the C
    module ``router.store._resp`` where it was built (every lookup sends a prompt's keys:
    ~0.1 ms for 512 in Python, bench_router), else in one format call."""
    if _fixed_decimals is not None:
        packed: bytes | None = _fixed_decimals(keys)
        if packed is not None:
            return packed
    return (b"%20d" * len(keys)) % tuple(keys)


def decode_key(member: bytes) -> BlockKey:
    """A router key from an index set member (a non-negative decimal below ``2**63``).

    Raises:
        PrefixIndexError: The member is not such a decimal.
    """
    try:
        value = int(member)
    except ValueError:
        raise PrefixIndexError(f"index set member {member!r} is not a router key") from None
    if not 0 <= value < _KEY_LIMIT:
        raise PrefixIndexError(f"index set member {member!r} is out of the 63-bit key range")
    return BlockKey(value)


def tag_text(tag: BlockKey) -> str:
    """A family tag as it appears in key names: 16 hex digits."""
    return f"{tag:016x}"


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

    def tier_set(self, tag: BlockKey, worker_id: WorkerId, tier: str) -> str:
        """Set of the router keys of family ``tag`` that a worker holds on ``tier``
        (``"g"``: GPU, ``"c"``: CPU); the scripts build the same names."""
        return f"{self.prefix}{tier}:{{{tag_text(tag)}}}:{worker_id}"

    def holders(self, tag: BlockKey) -> str:
        """Hash of one family: worker id -> number of entries it holds in the family."""
        return f"{self.prefix}h:{{{tag_text(tag)}}}"

    def lease(self, worker_id: WorkerId) -> str:
        """String ``"<epoch>:<owner>"`` with a TTL: the worker's single-writer lease."""
        return f"{self.prefix}lease:{{w:{worker_id}}}"

    def handoff(self, worker_id: WorkerId) -> str:
        """String with a TTL: the state the lease's previous holder handed over with it
        (:mod:`router.ingest.handoff`)."""
        return f"{self.prefix}handoff:{{w:{worker_id}}}"

    def worker(self, worker_id: WorkerId) -> str:
        """Hash of a worker's index state: ``epoch`` counter and ``entries`` count, and
        ``events_block_size`` while its events carry a block size other than its
        registration's (set by the router that reads them)."""
        return f"{self.prefix}worker:{{w:{worker_id}}}"

    def families(self, worker_id: WorkerId) -> str:
        """Set of the family tags a worker may hold entries in: O(its families) clears."""
        return f"{self.prefix}families:{{w:{worker_id}}}"

    @property
    def indexed(self) -> str:
        """Set of worker ids that may hold entries (what the reaper walks)."""
        return f"{self.prefix}indexed"

    @property
    def lease_holders(self) -> str:
        """Sorted set of live lease holders (routers, and tools such as a replay), scored
        by when their liveness lapses (ms): a lease of a holder not in it may be taken."""
        return f"{self.prefix}lease_holders"

    @property
    def routers(self) -> str:
        """Sorted set of live router ids, scored by when their heartbeat lapses (ms)."""
        return f"{self.prefix}routers"

    @property
    def registry(self) -> str:
        """Hash worker id -> JSON registration (endpoints, kind, block size)."""
        return f"{self.prefix}registry"

    def marker(self, tag: str) -> str:
        """Hash router id -> 1 in the slot of ``tag``: gone when its node lost its data
        (:mod:`router.store.markers`)."""
        return f"{self.prefix}alive:{{{tag}}}"

    @property
    def registry_version(self) -> str:
        """String set to a new random value after every change of :attr:`registry`."""
        return f"{self.prefix}registry_version"
