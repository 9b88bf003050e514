"""A worker's snapshot, as the router loads it, stands for the worker's whole event history:
the entries it gives, and what every later removal does to them.

The worker side is the real :class:`pool.snapshot.CachedChains` serving its runs as JSON;
the router side is the real :class:`router.workers.snapshot.Snapshot` decoded from those
bytes and folded through a :class:`router.ingest.bridge.WorkerBridge`, like a resync does.
"""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import RouterKeyer
from events.schema import BlockRemoved, BlockStored, KVCacheEvent
from pool.snapshot import CachedChains
from router.index.changes import Changes
from router.ingest.bridge import WorkerBridge
from router.workers.snapshot import Snapshot, snapshot_events

BS = 2


def stored(hashes: list[int], parent: int | None) -> BlockStored:
    tokens = [h * 10 + i for h in hashes for i in range(BS)]
    return BlockStored(hashes, parent, tokens, BS, None, "GPU", None)


def served(chains: CachedChains) -> Snapshot:
    """The snapshot as the router receives it: the worker's runs through JSON."""
    body = msgspec.json.encode({"block_size": BS, "runs": chains.runs(), "next_seq": 0})
    return msgspec.json.decode(body, type=Snapshot)


def fold(bridge: WorkerBridge, events: list[KVCacheEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            bridge.store(event, Changes())
        elif isinstance(event, BlockRemoved):
            bridge.remove(event, Changes())


def test_a_block_cached_twice_survives_its_first_removal_after_a_resync() -> None:
    chains = CachedChains(BS)
    history: list[KVCacheEvent] = [stored([1, 2], None), stored([2], 1)]  # 2: two copies
    chains.apply(history)
    snapshot = served(chains)
    assert [run.copies for run in snapshot.runs] == [[1, 2]]
    rebuilt = WorkerBridge(RouterKeyer(), tolerate_orphans=True)
    fold(rebuilt, list(snapshot_events(snapshot)))
    fold(rebuilt, [BlockRemoved([2], "GPU")])  # one copy goes; the worker keeps the other
    live = WorkerBridge(RouterKeyer())
    fold(live, [*history, BlockRemoved([2], "GPU")])
    assert rebuilt.entries() == live.entries()
    assert len(rebuilt.entries()) == 2


def test_runs_of_single_copies_carry_no_counts() -> None:
    chains = CachedChains(BS)
    chains.apply([stored([1, 2], None)])
    assert "copies" not in chains.runs()[0]
    assert served(chains).runs[0].copies is None


@st.composite
def histories(draw: st.DrawFn) -> list[KVCacheEvent]:
    """What a worker can publish: stores chaining off cached blocks, another physical
    copy of a cached block whose parent is cached (a second request that computed the
    same prefix), and removals of one copy of a cached block."""
    events: list[KVCacheEvent] = []
    parents: dict[int, int | None] = {}
    copies: dict[int, int] = {}
    for _ in range(draw(st.integers(1, 30))):
        cached = sorted(b for b, n in copies.items() if n)
        copyable = [b for b in cached if parents[b] is None or copies[parents[b] or 0]]
        action = draw(st.sampled_from(["store", "copy", "remove"]))
        if action == "remove" and cached:
            block = draw(st.sampled_from(cached))
            events.append(BlockRemoved([block], "GPU"))
            copies[block] -= 1
            continue
        if action == "copy" and copyable:
            block = draw(st.sampled_from(copyable))
        else:
            block = len(parents) + 1
            parents[block] = draw(st.none() | st.sampled_from(cached)) if cached else None
            copies[block] = 0
        events.append(stored([block], parents[block]))
        copies[block] += 1
    return events


@settings(max_examples=150, deadline=None)
@given(histories(), st.data())
def test_a_resynced_worker_matches_the_live_one_through_any_later_removals(
    history: list[KVCacheEvent], data: st.DataObject
) -> None:
    chains = CachedChains(BS)
    chains.apply(history)
    live = WorkerBridge(RouterKeyer(), tolerate_orphans=True)
    fold(live, history)
    rebuilt = loaded(chains)
    # Copies of cached blocks removed in any order, then every copy left. The resynced bridge always
    # holds at least what a resync at that moment would load (every reachable block the
    # worker still caches), and never more than the bridge that saw the whole history.
    removals = data.draw(st.permutations(sorted(chains.block_hashes) * 2))
    for block in [None, *removals, *sorted(chains.block_hashes) * len(history)]:
        if block is not None:
            for fed in (chains, live, rebuilt):
                fed_removal(fed, block)
        assert loaded(chains).entries().keys() <= rebuilt.entries().keys()
        assert rebuilt.entries().keys() <= live.entries().keys()
    assert rebuilt.entries() == live.entries() == {}


def loaded(chains: CachedChains) -> WorkerBridge:
    """A bridge as a resync leaves it: the worker's snapshot folded in, tolerantly."""
    bridge = WorkerBridge(RouterKeyer(), tolerate_orphans=True)
    fold(bridge, list(snapshot_events(served(chains))))
    return bridge


def fed_removal(target: CachedChains | WorkerBridge, block: int) -> None:
    removal = BlockRemoved([block], "GPU")
    if isinstance(target, CachedChains):
        target.apply([removal])
    else:
        fold(target, [removal])
