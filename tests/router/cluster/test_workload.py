"""Workloads: trace blocks to token ids, family slices, chats, the infinite-cache bound."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.cluster.trace_source import DEFAULT_TRACE_PATH, TraceSource, trace_workload
from router.cluster.workload import (
    TraceRecord,
    WorkloadError,
    block_tokens,
    chat_workload,
    ideal_hit_tokens,
    read_trace,
    select_families,
    trace_requests,
)


def _record(
    ts: int, ids: list[int], input_length: int | None = None, out: int = 512
) -> TraceRecord:
    length = 512 * len(ids) if input_length is None else input_length
    return TraceRecord(timestamp=ts, input_length=length, output_length=out, hash_ids=ids)


def test_block_tokens_are_a_pure_function_of_id_and_seed() -> None:
    a = block_tokens(7, 32)
    assert a == block_tokens(7, 32)
    assert len(a) == 32
    assert all(0 <= t < 256 for t in a)
    assert block_tokens(7, 8) == a[:8]
    assert block_tokens(8, 32) != a
    assert block_tokens(7, 32, seed=1) != a


def test_trace_requests_scale_blocks_partial_tail_and_output() -> None:
    records = [
        _record(1000, [1, 2, 3], input_length=512 * 2 + 100, out=1024),
        _record(1500, [1, 2], out=10),
    ]
    first, second = trace_requests(records, block_scale=16, max_output_tokens=20)
    # Two full blocks of 16, then ceil(100 * 16 / 512) = 4 tokens of block 3.
    assert first.token_ids == tuple(block_tokens(1, 16) + block_tokens(2, 16) + block_tokens(3, 4))
    assert first.max_tokens == 20  # 1024 * 16 / 512 = 32, capped at 20
    assert first.arrival_s == 0.0
    assert first.session == "family-1"
    assert second.token_ids == first.token_ids[:32]
    assert second.max_tokens == 1  # ceil(10 * 16 / 512) = 1
    assert second.arrival_s == 0.5


def test_trace_requests_reject_non_positive_scale() -> None:
    with pytest.raises(WorkloadError, match="block_scale"):
        trace_requests([_record(0, [1])], block_scale=0, max_output_tokens=4)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    a=st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True),
    b=st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True),
)
def test_shared_token_prefix_equals_shared_id_prefix(a: list[int], b: list[int]) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ra, rb = trace_requests([_record(0, a), _record(0, b)], block_scale=8, max_output_tokens=1)
    blocks_a = [ra.token_ids[i : i + 8] for i in range(0, len(ra.token_ids), 8)]
    blocks_b = [rb.token_ids[i : i + 8] for i in range(0, len(rb.token_ids), 8)]
    shared = 0
    while shared < min(len(a), len(b)) and blocks_a[shared] == blocks_b[shared]:
        shared += 1
    assert shared == common


def test_select_families_takes_largest_families_in_trace_order() -> None:
    records = [
        _record(0, [1, 10]),
        _record(1, [2, 20]),
        _record(2, [3]),
        _record(3, [2, 21]),
        _record(4, [1, 11]),
        _record(5, [2, 22]),
    ]
    chosen = select_families(records, num_families=2, num_requests=4)
    assert [r.timestamp for r in chosen] == [0, 1, 3, 4]
    assert select_families(records, num_families=1, num_requests=9) == [
        records[1],
        records[3],
        records[5],
    ]
    with pytest.raises(WorkloadError):
        select_families(records, num_families=0, num_requests=1)


def test_read_trace_parses_and_reports_bad_lines(tmp_path: Path) -> None:
    good = tmp_path / "t.jsonl"
    good.write_text(
        json.dumps({"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [4, 9]})
        + "\n\n"
    )
    assert read_trace(good) == [
        TraceRecord(timestamp=5, input_length=600, output_length=3, hash_ids=[4, 9])
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": "x"}\n')
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:1"):
        read_trace(bad)
    # The reader names no flag: each command adds a hint with its own flags.
    with pytest.raises(WorkloadError, match=r"^cannot read trace '[^']*missing\.jsonl' \([^)]*\)$"):
        read_trace(tmp_path / "missing.jsonl")


def test_chat_turns_extend_the_conversation_and_share_system_prompts() -> None:
    work = chat_workload(
        num_sessions=4, num_turns=3, num_system_prompts=2, system_tokens=32, user_tokens=8,
        reply_tokens=4, max_output_tokens=2, turn_gap_s=2.0,
    )  # fmt: skip
    assert len(work.requests) == 12
    by_session: dict[str, list[tuple[int, ...]]] = {}
    for request in work.requests:
        by_session.setdefault(request.session, []).append(request.token_ids)
    for prompts in by_session.values():
        assert [len(p) for p in prompts] == [40, 52, 64]
        for earlier, later in itertools.pairwise(prompts):
            assert later[: len(earlier)] == earlier
    assert by_session["chat-0"][0][:32] == by_session["chat-2"][0][:32]
    assert by_session["chat-0"][0][:32] != by_session["chat-1"][0][:32]
    assert [r.arrival_s for r in work.requests[:5]] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert work.num_output_tokens == 24
    assert chat_workload(seed=3) == chat_workload(seed=3)
    default = chat_workload()
    orders = {tuple(r.session for r in default.requests[t * 24 : (t + 1) * 24]) for t in range(4)}
    assert len(orders) == 4  # each turn comes in its own order


def test_ideal_hit_tokens_counts_only_previously_seen_prefix_blocks() -> None:
    a = list(range(32))
    b = list(range(16)) + [99] * 16
    c = list(range(32)) + [5] * 20
    # b reuses a's first block; c reuses a's two blocks; its partial tail never counts.
    assert ideal_hit_tokens([a, b, c], 16) == 16 + 32
    assert ideal_hit_tokens([b, b], 16) == 32


@pytest.mark.skipif(not DEFAULT_TRACE_PATH.is_file(), reason="optional Mooncake trace absent")
def test_default_mooncake_slice_has_reuse() -> None:
    source = TraceSource(DEFAULT_TRACE_PATH, "test")
    work = trace_workload(source, num_requests=50, num_families=8, block_scale=4)
    assert len(work.requests) == 50
    assert all(len(r.token_ids) > 0 for r in work.requests)
    prompts = [r.token_ids for r in work.requests]
    assert ideal_hit_tokens(prompts, 4) > work.num_prompt_tokens // 2
