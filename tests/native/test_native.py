"""The C modules against their Python references, and that they were built.

``events._keys.block_keys`` must equal ``events.hashing.python_block_keys`` and
``router.index._runs.store_run`` must equal ``router.index.runs.store_run_py`` on every
input: same result, same errors, same dicts afterwards. A bridge folding with either
must end in the same state with the same changes. ``router._resp.pack_command`` must
give hiredis's bytes for every command it packs, and decline the rest.
"""

from __future__ import annotations

import gc
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import router.ingest.bridge as bridge_module
from events.hashing import NATIVE_KEYS, BlockKey, RouterKeyer, python_block_keys
from events.native import PURE_PYTHON
from events.schema import NATIVE_DECODE, AllBlocksCleared, BlockRemoved, BlockStored
from router.index.changes import Changes
from router.ingest._native.runs import NATIVE_RUNS, dict_map, remove_run_py, store_run_py
from router.ingest._native.words import COPY_LANES, CPU_SHIFT, GPU_SHIFT, KEY_LANES
from router.ingest.bridge import WorkerBridge


def _built(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


BUILT = all(
    map(
        _built,
        ("events._keys", "events._wire", "router.ingest._native._runs", "router.store._resp"),
    )
)
needs_native = pytest.mark.skipif(not BUILT, reason="C modules not built (no C compiler)")


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "").split()
    return shutil.which(cc[0]) if cc else None


@pytest.mark.skipif(_compiler() is None, reason="no C compiler: the Python fallback runs")
def test_the_c_modules_are_built_and_used_where_a_compiler_exists() -> None:
    # An install with a compiler that silently fell back to Python would be slower on
    # the ingest's hot path: catch a broken build here.
    assert BUILT
    assert (not PURE_PYTHON,) * 3 == (NATIVE_KEYS, NATIVE_RUNS, NATIVE_DECODE)


@pytest.mark.slow
def test_kvroute_pure_python_runs_the_references() -> None:
    code = (
        "from events.hashing import NATIVE_KEYS; "
        "from router.ingest._native.runs import NATIVE_RUNS; "
        "from events.schema import NATIVE_DECODE; "
        "print(NATIVE_KEYS, NATIVE_RUNS, NATIVE_DECODE)"
    )
    env = {**os.environ, "KVROUTE_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False", "False"], out.stderr


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", call())
    except Exception as exc:  # the type is what must agree, not the wording
        return ("raises", type(exc))


# ---- router keys -------------------------------------------------------------------------


@pytest.mark.slow
@needs_native
@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=400),
    block_size=st.integers(1, 70),
    parent=st.integers(0, 2**64 - 1),
)
def test_block_keys_equal_the_python_reference(
    tokens: list[int], block_size: int, parent: int
) -> None:
    # Block sizes 1-70 cross every input length class of XXH3 (4..280 bytes): lengths the
    # C module hashes itself (17-128 bytes) and those it hands to the xxhash package.
    from events._keys import block_keys

    assert block_keys(tokens, block_size, parent) == python_block_keys(tokens, block_size, parent)
    assert block_keys(tuple(tokens), block_size, parent) == block_keys(tokens, block_size, parent)


@needs_native
@pytest.mark.parametrize(
    ("tokens", "block_size", "parent", "error"),
    [
        # Token ids outside uint32 are OverflowError: the bridge counts the event malformed.
        ([-1] * 16, 16, 0, OverflowError),
        ([2**32] * 16, 16, 0, OverflowError),
        ([2**70] * 16, 16, 0, OverflowError),
        ([1] * 16, 16, -1, OverflowError),
        ([1] * 16, 16, 2**64, OverflowError),
        ([1] * 15 + ["x"], 16, 0, TypeError),
        ([1.5] * 16, 16, 0, TypeError),
        (None, 16, 0, TypeError),
        ([1] * 16, 0, 0, ValueError),
        ([1] * 16, -4, 0, ValueError),
    ],
)
def test_block_keys_raise_what_the_python_reference_raises(
    tokens: Any, block_size: int, parent: int, error: type[Exception]
) -> None:
    from events._keys import block_keys

    assert outcome(lambda: block_keys(tokens, block_size, parent)) == ("raises", error)
    assert outcome(lambda: python_block_keys(tokens, block_size, parent)) == ("raises", error)


# ---- the bulk store ----------------------------------------------------------------------

small = st.integers(0, 12)  # a small universe, so held, repeated and chained items collide
Maps = tuple[dict[Any, int], dict[BlockKey, int], dict[BlockKey, int]]


@st.composite
def maps_and_runs(draw: st.DrawFn) -> tuple[Maps, tuple[Any, ...]]:
    copies = draw(st.dictionaries(small, st.integers(1, 2**128)))
    keys = draw(st.dictionaries(small.map(BlockKey), st.integers(1, 2**193)))
    children = draw(st.dictionaries(small.map(BlockKey), small))
    length = draw(st.integers(1, 6))
    hashes = draw(st.lists(st.one_of(small, st.integers(-3, -1), st.binary(min_size=1, max_size=2)),
                           min_size=length, max_size=length))  # fmt: skip
    run_keys = draw(st.lists(small.map(BlockKey), min_size=length, max_size=length))
    tag = draw(small.map(BlockKey))
    parent = draw(st.none() | small.map(BlockKey))
    tier = draw(st.sampled_from([GPU_SHIFT, CPU_SHIFT]))
    return (copies, keys, children), (hashes, run_keys, tag, parent, tier, draw(st.booleans()))


@pytest.mark.slow
@needs_native
@settings(max_examples=500, deadline=None)
@given(case=maps_and_runs())
def test_store_run_equals_the_python_reference(case: tuple[Maps, tuple[Any, ...]]) -> None:
    from router.ingest._native._runs import store_run

    maps, run = case
    mine = tuple(dict(m) for m in maps)
    theirs = tuple(dict(m) for m in maps)
    assert store_run(*mine, *run) == store_run_py(*theirs, *run)  # type: ignore[arg-type]
    # Same contents in the same insertion order (the handoff encodes the maps in order).
    assert [list(m.items()) for m in mine] == [list(m.items()) for m in theirs]


@needs_native
@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({0: [], 3: []}, TypeError),  # a dict or list of the wrong type
        ({4: [1, 2]}, ValueError),  # keys and hashes differ in number
        ({3: [], 4: []}, ValueError),  # an empty run
        ({4: [2**63]}, ValueError),  # a router key out of range
        ({4: [-1]}, OverflowError),
        ({5: 2**64}, OverflowError),  # the tag
        ({7: 16}, ValueError),  # not a tier
    ],
)
def test_store_run_rejects_bad_arguments_and_changes_nothing(
    change: dict[int, Any], error: type[Exception]
) -> None:
    from router.ingest._native._runs import store_run

    maps: list[Any] = [{1: 1 << 64}, {BlockKey(7): 1}, {BlockKey(7): 8}]
    args: list[Any] = [*maps, [10], [BlockKey(20)], BlockKey(20), None, GPU_SHIFT, True]
    before = [dict(m) for m in maps]
    for position, value in change.items():
        args[position] = value
    with pytest.raises(error):
        store_run(*args)
    assert maps == before


# ---- a whole bridge ----------------------------------------------------------------------

BS = 16  # 64-byte blocks: the C module hashes them itself
NODES = {0: None, 1: 0, 2: 1, 3: 1, 4: None, 5: 4}  # node -> parent: two families, a branch


def tokens(node: int) -> list[int]:
    return [node * 100 + i for i in range(BS)]


def chain(node: int) -> list[int]:
    out = [node]
    while (up := NODES[out[-1]]) is not None:
        out.append(up)
    return out[::-1]


@st.composite
def events(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
    medium = draw(st.sampled_from(["GPU", "GPU", "CPU"]))
    if kind == "clear":
        return AllBlocksCleared()
    path = chain(draw(st.sampled_from(sorted(NODES))))
    first = draw(st.integers(0, len(path) - 1))
    nodes = path[first:]
    # Hash 50 + node, but sometimes the engine reuses one hash for two blocks; hashes are
    # unsigned, signed (Python's hash()) or bytes (an older vLLM), drawn per event.
    kind_of_hash = draw(st.sampled_from([int, lambda h: -h, lambda h: h.to_bytes(2, "big")]))
    hashes = [kind_of_hash(draw(st.sampled_from([50 + n, 50 + n, 77]))) for n in nodes]
    if kind == "remove":  # in chain order or tail first (vLLM's eviction order)
        return BlockRemoved(
            block_hashes=draw(st.sampled_from([hashes, hashes[::-1]])), medium=medium
        )
    parent = None if first == 0 else kind_of_hash(draw(st.sampled_from([50 + path[first - 1], 99])))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[t for n in nodes for t in tokens(n)],
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def fold(events_: list[Any], monkeypatch: pytest.MonkeyPatch, *native: Any) -> Any:
    """Fold ``events_`` through a bridge whose store_run, remove_run and new_map are
    ``native``: the C module's, or the Python references."""
    for name, value in zip(("store_run", "remove_run", "new_map"), native, strict=True):
        monkeypatch.setattr(bridge_module, name, value)
    bridge = WorkerBridge(RouterKeyer(seed=5), tolerate_orphans=True)
    trace = []
    for event in events_:
        changes = Changes()
        if isinstance(event, AllBlocksCleared):
            changes = bridge.reset()
        elif isinstance(event, BlockStored):
            bridge.store(event, changes)
        else:
            bridge.remove(event, changes)
        trace.append(changes.masks())
    state = bridge.state()
    return trace, state.copies, state.keys, bridge.counters, dict(bridge._children)


@pytest.mark.slow
@needs_native
@settings(max_examples=600, deadline=None)
@given(history=st.lists(events(), max_size=24))
def test_a_bridge_folds_the_same_with_either_store(history: list[Any]) -> None:
    from router.ingest._native._runs import WordMap, remove_run, store_run

    with pytest.MonkeyPatch.context() as monkeypatch:
        native = fold(history, monkeypatch, store_run, remove_run, WordMap)
        python = fold(history, monkeypatch, store_run_py, remove_run_py, dict_map)
    assert native == python


# ---- packing index writes ------------------------------------------------------------------

simple_arg = st.one_of(
    st.binary(max_size=30),
    st.text(max_size=10),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, -1, 9, 10, 99, 100, 10**18, 2**63 - 1, -(2**63)]),
)
other_arg = st.one_of(
    st.integers(2**63, 2**80), st.floats(), st.just(True), st.just(None), st.just(bytearray(b"x"))
)


@pytest.mark.slow
@needs_native
@settings(max_examples=400, deadline=None)
@given(args=st.lists(simple_arg, max_size=40))
def test_pack_command_equals_hiredis(args: list[Any]) -> None:
    import hiredis
    from router.store._resp import pack_command

    assert pack_command(tuple(args)) == hiredis.pack_command(tuple(args))


@pytest.mark.slow
@needs_native
@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.one_of(
            simple_arg.map(lambda a: [a]),  # one plain argument
            st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30),  # ints packed together
        ),
        max_size=8,
    )
)
def test_packed_args_send_the_ints_they_hold(parts: list[list[Any]]) -> None:
    # A write's keys go as one PackedArgs per key list: on the wire, the same command as
    # with the ints one argument each.
    import hiredis
    from router.store._resp import pack_args, pack_command

    mixed = [p[0] if len(p) == 1 and not isinstance(p[0], int) else pack_args(p) for p in parts]
    flat = [a for p in parts for a in p]
    sizes = [1 if isinstance(m, (str, bytes)) else len(m) for m in mixed]
    assert sizes == list(map(len, parts))
    assert pack_command(("EVALSHA", *mixed)) == hiredis.pack_command(("EVALSHA", *flat))


@pytest.mark.slow
@needs_native
@settings(max_examples=300, deadline=None)
@given(ints=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=600))
def test_fixed_decimals_equal_python_s_formatting(ints: list[int]) -> None:
    from router.store._resp import fixed_decimals

    assert fixed_decimals(ints) == (b"%20d" * len(ints)) % tuple(ints)


@needs_native
def test_fixed_decimals_decline_what_python_must_format() -> None:
    from router.store._resp import fixed_decimals

    from router.store.layout import encode_keys_fixed

    for other in ((1, 2), [2**63], [-(2**63) - 1], [True], [1.0]):
        assert fixed_decimals(other) is None
    assert encode_keys_fixed((7, 2**64)) == b"%20d%20d" % (7, 2**64)  # formatted in Python


@needs_native
def test_pack_args_refuses_what_is_not_a_list_of_64_bit_ints() -> None:
    from router.store._resp import PackedArgs, pack_args

    for bad, error in (((1, 2), TypeError), ([1, "2"], TypeError), ([True], TypeError),
                       ([2**63], OverflowError)):  # fmt: skip
        with pytest.raises(error):
            pack_args(bad)
    with pytest.raises(TypeError):
        PackedArgs()  # only pack_args makes them


@pytest.mark.slow
@needs_native
@settings(max_examples=200, deadline=None)
@given(args=st.lists(simple_arg, max_size=5), other=other_arg, at=st.integers(0, 5))
def test_pack_command_declines_what_it_does_not_pack(args: list[Any], other: Any, at: int) -> None:
    # Ints beyond 64 bits, floats, bools, None...: None, and the connection packs the
    # command with hiredis (which also owns the errors for the types it rejects).
    from router.store._resp import pack_command

    args.insert(min(at, len(args)), other)
    assert pack_command(tuple(args)) is None
    assert pack_command(("SET", "\ud800")) is None  # no UTF-8: hiredis reports it


# ---- the bridge's compact maps ----------------------------------------------------------

map_key = st.one_of(
    st.integers(-40, 40),  # collide in a small table, and across resizes
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([-1, 2**64 - 1, -(2**63), 2**63]),  # same low 64 bits, or the edges
    st.sampled_from([2**64, -(2**63) - 1, -(2**70), b"\x01", b"", "s"]),  # beside the table
)
map_value = st.one_of(st.integers(0, 2**64), st.integers(0, 2**260), st.just(-5))
map_op = st.one_of(
    st.tuples(st.just("set"), map_key, map_value),
    st.tuples(st.just("del"), map_key, st.none()),
    st.tuples(st.just("pop"), map_key, st.none()),
    st.tuples(st.just("get"), map_key, st.none()),
    st.tuples(st.just("clear"), st.none(), st.none()),
    st.tuples(st.just("update"), st.dictionaries(map_key, map_value, max_size=5), st.none()),
)


@pytest.mark.slow
@needs_native
@settings(max_examples=300, deadline=None)
@given(lanes=st.integers(1, 4), ops=st.lists(map_op, max_size=120))
def test_wordmap_behaves_as_a_dict(lanes: int, ops: list[tuple[str, Any, Any]]) -> None:
    # Values too wide for the lanes, negative ones and keys that are not 64-bit ints go
    # to the side dict: to a user the two are one mapping.
    from router.ingest._native._runs import WordMap

    mine, model = WordMap(lanes), {}
    for op, key, value in ops:
        if op == "set":
            mine[key] = model[key] = value
        elif op == "update":
            mine.update(key)
            model.update(key)
        elif op == "clear":
            mine.clear()
            model.clear()
        elif op in ("del", "pop"):
            want = outcome(lambda k=key: model.pop(k))
            got = outcome(lambda k=key, o=op: mine.pop(k) if o == "pop" else mine.__delitem__(k))
            assert got[0] == want[0]
            if op == "pop":
                assert got == want
        else:
            assert mine.get(key, "none") == model.get(key, "none")
            assert (key in mine) == (key in model)
        assert len(mine) == len(model)
    assert dict(mine) == model == dict(mine.items())
    assert sorted(map(repr, mine)) == sorted(map(repr, model))
    assert not gc.is_tracked(mine)
    with pytest.raises(TypeError):
        mine[1] = mine  # not an int: refused (a cycle the collector would never see)


@pytest.mark.slow
@needs_native
@settings(max_examples=500, deadline=None)
@given(case=maps_and_runs(), ghosts=st.lists(st.integers(-12, 30), max_size=24))
def test_store_run_on_wordmaps_equals_the_python_reference(
    case: tuple[Maps, tuple[Any, ...]], ghosts: list[int]
) -> None:
    from router.ingest._native._runs import WordMap, store_run

    maps, run = case
    tables = []
    for lanes, entries in zip((COPY_LANES, KEY_LANES, 1), maps, strict=True):
        # Ghosts inserted first and deleted last leave tombstones in the probe chains
        # before the entries: a held key behind one must still be found.
        table = WordMap(lanes)
        table.update(dict.fromkeys(ghosts, 1))
        table.update(entries)
        for ghost in set(ghosts) - entries.keys():
            del table[ghost]
        tables.append(table)
    theirs = tuple(dict(m) for m in maps)
    stored = store_run(*tables, *run)
    assert stored == store_run_py(*theirs, *run) or (  # type: ignore[arg-type]
        # Runs of engine hashes that are not 64-bit ints go block by block on WordMaps.
        not stored and not all(isinstance(h, int) for h in run[0])
    )
    if stored or all(isinstance(h, int) for h in run[0]):
        assert [dict(t) for t in tables] == list(theirs)
    else:
        assert [dict(t) for t in tables] == list(maps)
