"""A small prefix tree of blocks, its events, and a Hypothesis strategy of those events.

Node ``n`` is one block of two tokens ``[10n, 10n + 1]`` whose parent is ``PARENT[n]``;
its engine hash is ``1000 + n``; tier 1 is GPU, tier 2 CPU. The index property tests
compare an index with a model of this tree; the handoff tests fold the same events.
"""

from __future__ import annotations

from hypothesis import strategies as st

from events.hashing import BlockKey, RouterKeyer
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored

BS = 2
KEYER = RouterKeyer()
# A small prefix tree: node -> parent (None: a root). Tokens of node n: [10n, 10n + 1].
PARENT: dict[int, int | None] = {0: None, 1: None, 2: 0, 3: 2, 4: 0, 5: 3, 6: 1, 7: 6}
CHILD = {p: n for n, p in sorted(PARENT.items(), reverse=True) if p is not None}
TIERS = {1: "GPU", 2: "CPU"}


def path(node: int) -> list[int]:
    """The nodes from the root down to ``node``."""
    out = [node]
    while (parent := PARENT[out[-1]]) is not None:
        out.append(parent)
    return out[::-1]


def tokens(node: int) -> list[int]:
    return [10 * node, 10 * node + 1]


KEY: dict[int, BlockKey] = {
    n: KEYER.keys([t for p in path(n) for t in tokens(p)], BS)[-1] for n in PARENT
}
"""The router key of each node (its whole path hashed)."""


def block_hash(node: int) -> int:
    return 1000 + node


def store_event(nodes: list[int], tier: int) -> BlockStored:
    """``nodes`` (a chain, parent first) stored on ``tier``."""
    parent = PARENT[nodes[0]]
    return BlockStored(
        block_hashes=[block_hash(n) for n in nodes],
        parent_block_hash=None if parent is None else block_hash(parent),
        token_ids=[t for n in nodes for t in tokens(n)],
        block_size=BS,
        lora_id=None,
        medium=TIERS[tier],
        lora_name=None,
    )


node_st = st.sampled_from(sorted(PARENT))
tier_st = st.sampled_from([1, 1, 2])
event_st = st.one_of(
    st.builds(lambda n, t: store_event([n], t), node_st, tier_st),
    st.builds(lambda n, t: store_event([n, CHILD[n]], t), st.sampled_from(sorted(CHILD)), tier_st),
    st.builds(
        lambda n, t: BlockRemoved(block_hashes=[block_hash(n)], medium=TIERS[t]), node_st, tier_st
    ),
    st.just(AllBlocksCleared()),
)
"""One event on the tree: a store of a node or of a node and its child, a removal, a clear."""
