"""The built-in trace generator and the choice of trace: what a bare clone runs on."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from router.cluster.trace_generator import (
    BUILTIN_TRACE_NAME,
    GeneratorConfig,
    LogNormal,
    generate_trace,
)
from router.cluster.trace_source import BUILTIN_NUM_REQUESTS, choose_trace, trace_workload
from router.cluster.workload import TRACE_BLOCK_TOKENS, TraceRecord, WorkloadError
from router.sim.trace import ideal_hits, to_requests


def test_the_trace_is_a_pure_function_of_its_arguments_and_grows_by_appending() -> None:
    short = generate_trace(200)
    assert generate_trace(200) == short
    assert generate_trace(500)[:200] == short
    assert generate_trace(200, seed=1) != short


def test_records_are_valid_mooncake_records() -> None:
    records = generate_trace(1000)
    assert len(records) == 1000
    assert records[0].timestamp == 0
    requests = to_requests(records)  # checks block counts, 32-bit ids, time order
    assert len(requests) == 1000
    ids_seen = sorted({h for r in records for h in r.hash_ids})
    assert ids_seen == list(range(len(ids_seen)))  # numbered in order of first appearance
    assert all(r.output_length >= 1 for r in records)


def test_ids_are_chained_an_id_names_its_whole_prefix() -> None:
    parent_of: dict[int, int | None] = {}
    for record in generate_trace(1500):
        previous: int | None = None
        for hash_id in record.hash_ids:
            assert parent_of.setdefault(hash_id, previous) == previous
            previous = hash_id


@pytest.mark.slow
def test_turns_extend_the_conversation_and_families_share_a_prefix() -> None:
    records = generate_trace(2000)
    full_prefixes = {tuple(r.hash_ids[: r.input_length // TRACE_BLOCK_TOKENS]) for r in records}
    # A later turn holds the whole earlier prompt, so its leading full blocks are an earlier
    # request's: count requests whose first two blocks some earlier request also had.
    seen: set[tuple[int, ...]] = set()
    reusing = 0
    for record in records:
        head = tuple(record.hash_ids[:2])
        reusing += head in seen
        seen.add(head)
    assert reusing > len(records) // 2
    assert len(full_prefixes) > len(records) // 2  # yet most prompts differ
    first_blocks = Counter(r.hash_ids[0] for r in records)
    # Zipf over the families: the most popular first block opens many requests.
    assert first_blocks.most_common(1)[0][1] > 100


@pytest.mark.slow
def test_default_statistics_are_the_documented_ones() -> None:
    """docs/workload.md, "What the default gives": the figures of generate_trace(6000)."""
    records = generate_trace(BUILTIN_NUM_REQUESTS)
    assert len(records) == 6000
    assert round(records[-1].timestamp / 60_000, 1) == 27.8
    distinct = {h for r in records for h in r.hash_ids}
    assert len(distinct) == 52_537
    assert len(distinct) > 8 * 5_859  # larger than the simulator's default cluster cache
    assert round(ideal_hits(to_requests(records)).hit_rate_blocks, 3) == 0.743
    assert round(sum(r.input_length for r in records) / len(records)) == 17_197


def test_settings_out_of_range_are_refused() -> None:
    with pytest.raises(WorkloadError, match="requests_per_s must be > 0"):
        GeneratorConfig(requests_per_s=0)
    with pytest.raises(WorkloadError, match="family_fraction in"):
        GeneratorConfig(family_fraction=1.5)
    with pytest.raises(WorkloadError, match="num_requests must be positive"):
        generate_trace(0)
    assert LogNormal(100, 0.0, 1, 50).draw(random.Random(0)) == 50  # clipped


def test_a_session_without_think_time_or_family_still_forms() -> None:
    config = GeneratorConfig(think_time_s=0, family_fraction=0.0, mean_turns=1)
    records = generate_trace(50, config)
    assert len({r.hash_ids[0] for r in records}) == 50  # nothing shared: all first turns
    assert GeneratorConfig().summary().startswith("Poisson arrivals at 4 requests/s")


def test_the_choice_of_trace(tmp_path: Path) -> None:
    given = tmp_path / "given.jsonl"
    default = tmp_path / "default.jsonl"
    default.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [3]}')
    source = choose_trace(str(given), default)
    assert (source.path, source.is_given) == (given, True)
    assert source.describe() == f"workload: trace {given} (--trace)"
    with pytest.raises(WorkloadError, match=r"fix --trace, or leave it out to use the default$"):
        source.records()

    found = choose_trace(None, default)
    assert (found.path, found.is_given) == (default, False)
    assert "found beside the checkout" in found.describe()
    assert found.records() == [TraceRecord(0, 10, 1, [3])]

    builtin = choose_trace(None, tmp_path / "absent.jsonl")
    assert builtin.path is None and builtin.name == BUILTIN_TRACE_NAME
    assert builtin.describe().startswith(f"workload: {BUILTIN_TRACE_NAME} (no --trace given")
    assert builtin.records(300, seed=2) == generate_trace(300, seed=2)


@pytest.mark.slow
def test_the_cluster_slice_of_the_built_in_trace() -> None:
    builtin = choose_trace(None, Path("/nonexistent/trace.jsonl"))
    work = trace_workload(builtin, num_requests=40, num_families=12)
    assert len(work.requests) == 40
    assert work.description == (
        f"40 requests of the 12 largest prefix families of {BUILTIN_TRACE_NAME}, "
        "16 tokens per 512-token trace block"
    )
    assert all(0 <= t < 256 for r in work.requests for t in r.token_ids)
