"""Tests of the trace simulator: trace reading, the ideal, the engine over real pools, the CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.cli.main import main as kvroute
from router.cli.sim import pool_cache_factory, run_policies
from router.cluster.trace_generator import generate_trace
from router.cluster.trace_source import DEFAULT_TRACE_PATH
from router.routing.policies import POLICY_NAMES, make_policy
from router.sim.engine import RequestOutcome, SimConfig, simulate
from router.sim.report import summarize
from router.sim.trace import SimError, SimRequest, ideal_hits, load_trace, to_requests
from tests.support.paths import REPO_ROOT as REPO
from tests.support.traces import rec, write_trace

pytestmark = pytest.mark.slow

needs_mooncake = pytest.mark.skipif(
    not DEFAULT_TRACE_PATH.is_file(), reason="optional Mooncake trace absent"
)






def test_requests_get_consistent_tokens_and_relative_arrivals() -> None:
    reqs = to_requests([rec(1000, [7, 8], length=700), rec(1500, [7, 9], length=1024)])
    assert [r.arrival_s for r in reqs] == [0.0, 0.5]
    a, b = reqs[0].token_ids(), reqs[1].token_ids()
    assert len(a) == 700 and len(b) == 1024
    assert a[:512] == b[:512] == [7] * 512
    assert a[512:] == [8] * 188


def test_bad_records_are_rejected_with_the_reason() -> None:
    with pytest.raises(SimError, match=r"3 hash_ids for input_length 1024"):
        to_requests([rec(0, [1, 2, 3], length=1024)])
    with pytest.raises(SimError, match="sort the trace"):
        to_requests([rec(5, [1]), rec(4, [2])])
    with pytest.raises(SimError, match="32 bits"):
        to_requests([rec(0, [2**32])])


def test_ideal_counts_blocks_whose_whole_prefix_was_seen() -> None:
    reqs = to_requests(
        [rec(0, [1, 2, 3]), rec(1, [1, 2, 4], length=1100), rec(2, [5, 2]), rec(3, [1, 2, 4])]
    )
    ideal = ideal_hits(reqs)
    # Request 2 hits 1, 2; request 3 none (5 unseen, so 2 does not count); request 4 all 3.
    assert (ideal.num_blocks, ideal.num_hit_blocks) == (11, 5)
    assert ideal.num_hit_tokens == 2 * 512 + 3 * 512
    assert ideal.num_tokens == 3 * 512 + 1100 + 2 * 512 + 3 * 512


@needs_mooncake
def test_ideal_of_the_mooncake_trace_is_the_published_figure() -> None:
    ideal = ideal_hits(load_trace(DEFAULT_TRACE_PATH))
    assert (ideal.num_blocks, ideal.num_hit_blocks) == (121_877, 77_953)
    assert round(ideal.hit_rate_blocks, 4) == 0.6396


def run(reqs: list[SimRequest], policy: str, **config: Any) -> list[RequestOutcome]:
    cfg = SimConfig(**config)
    return asyncio.run(simulate(reqs, make_policy(policy, cfg.policy), cfg, pool_cache_factory()))


def test_latency_model_queue_prefill_and_the_hit_found_at_prefill_start() -> None:
    # Two identical 1,024-token prompts at t=0 on one worker at 1,000 tokens/s. The first
    # computes 1,024 tokens; the second starts when it is done and finds block 0 cached
    # (the last block is recomputed: the last prompt token is never a hit).
    reqs = to_requests([rec(0, [1, 2]), rec(0, [1, 2])])
    out = run(reqs, "round_robin", num_workers=1, prefill_tokens_per_s=1000.0)
    assert [(o.hit_tokens, o.prefill_tokens) for o in out] == [(0, 1024), (512, 512)]
    assert [o.ttft_s for o in out] == [1.024, 1.536]


def test_a_request_waits_for_blocks_held_by_running_requests() -> None:
    # 3 blocks of capacity: the second request (2 blocks) must wait for the first to
    # finish decoding (10 tokens x 0.5 s) before it can be admitted.
    reqs = to_requests([rec(0, [1, 2], out=10), rec(0, [3, 4], out=10)])
    out = run(
        reqs,
        "round_robin",
        num_workers=1,
        capacity_blocks=3,
        prefill_tokens_per_s=1024.0,
        decode_s_per_token=0.5,
    )
    assert [o.ttft_s for o in out] == [1.0, 1.0 + 5.0 + 1.0]
    with pytest.raises(SimError, match="raise --capacity-blocks"):
        run(to_requests([rec(0, [1, 2, 3, 4])]), "round_robin", capacity_blocks=3)


def test_cache_aware_keeps_a_burst_of_siblings_together_through_predicted_entries() -> None:
    # Five siblings arrive within 10 ms, long before the first one's blocks are announced
    # (its prefill takes 7.2 s): only predicted entries can tell the router where they go.
    family = [rec(i * 2, [1, 2, 3, 4, 5, 6, 7, 8, 100 + i]) for i in range(5)]
    reqs = to_requests(family)
    cache_aware = run(reqs, "cache_aware", num_workers=4, prefill_tokens_per_s=640.0)
    assert {o.worker for o in cache_aware} == {cache_aware[0].worker}
    assert [o.hit_tokens for o in cache_aware] == [0] + [8 * 512] * 4
    assert [o.predicted_tokens for o in cache_aware] == [0] + [8 * 512] * 4
    spread = run(reqs, "round_robin", num_workers=4, prefill_tokens_per_s=640.0)
    assert [o.worker for o in spread] == [0, 1, 2, 3, 0]
    assert [o.hit_tokens for o in spread] == [0, 0, 0, 0, 8 * 512]


def test_a_one_block_system_prompt_every_request_shares_spreads_over_all_workers() -> None:
    # 200 requests, 50 ms apart, all starting with block 0 then two blocks of their own.
    # Each worker computes block 0 once (3 misses beyond the ideal's 1): once two workers
    # hold it, it counts as replicated and costs the others little to acquire, and the
    # fair-share term spreads the rest evenly instead of piling it on the first worker
    # that cached it.
    reqs = to_requests([rec(i * 50, [0, 1000 + 2 * i, 1001 + 2 * i]) for i in range(200)])
    outcomes = run(reqs, "cache_aware", num_workers=4)
    result = summarize("cache_aware", reqs, outcomes, ideal_hits(reqs), 4, 0.0, 0.0)
    assert result.requests_per_worker == (50, 50, 50, 50)
    assert (result.num_hit_blocks, result.ideal.num_hit_blocks) == (196, 199)
    assert result.load_imbalance <= 1.25


@needs_mooncake
def test_policies_on_a_slice_of_the_mooncake_trace() -> None:
    reqs = load_trace(DEFAULT_TRACE_PATH, limit=600)
    results = run_policies(reqs, ["cache_aware", "round_robin"], SimConfig(), pool_cache_factory())
    cache_aware, round_robin = results
    assert cache_aware.ideal == round_robin.ideal == ideal_hits(reqs)
    assert cache_aware.ratio_to_ideal >= 0.98  # 0.997 when written
    assert cache_aware.hit_rate_blocks >= 3 * round_robin.hit_rate_blocks
    assert cache_aware.load_imbalance <= 1.25
    assert cache_aware.num_predicted_tokens == cache_aware.num_hit_tokens
    assert sum(cache_aware.requests_per_worker) == 600


def test_policies_on_the_built_in_trace() -> None:
    reqs = to_requests(generate_trace(600))
    results = run_policies(reqs, ["cache_aware", "round_robin"], SimConfig(), pool_cache_factory())
    cache_aware, round_robin = results
    assert cache_aware.ideal == round_robin.ideal == ideal_hits(reqs)
    assert cache_aware.ratio_to_ideal >= 0.97  # 0.993 when written
    assert cache_aware.hit_rate_blocks >= 2.5 * round_robin.hit_rate_blocks  # 2.96x then
    assert cache_aware.load_imbalance <= 1.5  # 1.35: 600 requests are few for 8 workers
    assert sum(cache_aware.requests_per_worker) == 600


def test_kvroute_sim_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl", [rec(i * 100, [1, 2, 10 + i % 3], out=5) for i in range(12)]
    )
    png = tmp_path / "sim.png"
    argv = ["sim", "--trace", str(trace), "--workers", "2", "--json", "--plot", str(png)]
    assert kvroute(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) == {
        "cache_aware",
        "approximate",
        "consistent_hash",
        "least_loaded",
        "random",
        "round_robin",
    }
    for figures in report["policies"].values():
        assert {
            "hit_rate_blocks",
            "hit_rate_tokens",
            "ideal_hit_rate_blocks",
            "load_imbalance",
            "ttft_p50_s",
            "ttft_p99_s",
        } <= set(figures)
        assert figures["ideal_hit_rate_blocks"] == 31 / 36  # 0 + 2 + 2 + 3 x 9
        # 2 workers x 5,859 blocks hold the whole trace: the pooled LRU is the ideal.
        assert figures["pooled_lru_hit_rate_blocks"] == 31 / 36
        assert figures["ratio_to_pooled_lru"] == figures["ratio_to_ideal"]
        assert figures["ttft_mean_s"] > 0
    assert report["pooled_lru_hit_rate_blocks"] == report["ideal_hit_rate_blocks"] == 31 / 36
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kvroute_sim_table_and_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [rec(0, [1]), rec(10, [1, 2])])
    assert kvroute(["sim", "--trace", str(trace), "--policy", "least_loaded"]) == 0
    out = capsys.readouterr().out
    assert "least_loaded" in out and "infinite-cache ideal: 33.33% of blocks" in out
    assert "pooled-LRU bound (one LRU cache of the cluster's capacity" in out
    assert kvroute(["sim", "--trace", str(trace), "--policy", "nope"]) == 1
    assert "unknown policy 'nope'" in caplog.text
    assert kvroute(["sim", "--trace", str(tmp_path / "missing.jsonl")]) == 1
    assert "cannot read trace" in caplog.text
    with pytest.raises(SystemExit) as exc:
        kvroute(["sim", "--help"])
    assert exc.value.code == 0
    assert "--capacity-blocks" in capsys.readouterr().out


def test_the_router_side_of_the_simulator_does_not_import_pool() -> None:
    code = (
        "import sys, router.sim, router.cli.sim, router.routing.policies; "
        "import router.routing.predicted; "
        "assert not any(m == 'pool' or m.startswith('pool.') for m in sys.modules), 'pool'; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


_traces = st.lists(
    st.tuples(
        st.integers(0, 300),  # gap to the previous arrival, ms
        st.lists(st.integers(0, 5), min_size=1, max_size=4),  # path in a small prefix tree
        st.integers(1, 511),  # tokens of a partial last block
        st.integers(0, 20),  # output tokens
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=25, deadline=None)
@given(trace=_traces, policy=st.sampled_from(POLICY_NAMES), workers=st.integers(1, 3))
def test_no_policy_hits_more_than_what_earlier_requests_computed(
    trace: list[tuple[int, list[int], int, int]], policy: str, workers: int
) -> None:
    records, now = [], 0
    id_of: dict[tuple[int, ...], int] = {}  # like the trace's: an id names a whole prefix
    for gap, path, tail, out in trace:
        now += gap
        ids = [id_of.setdefault(tuple(path[: i + 1]), len(id_of)) for i in range(len(path))]
        records.append(rec(now, ids, length=512 * (len(ids) - 1) + tail, out=out))
    reqs = to_requests(records)
    out = run(reqs, policy, num_workers=workers, capacity_blocks=16, prefill_tokens_per_s=5000.0)
    seen: set[int] = set()
    for r, o in zip(reqs, out, strict=True):
        depth = 0
        while depth < len(r.hash_ids) and r.hash_ids[depth] in seen:
            depth += 1
        seen.update(r.hash_ids)
        assert o.index == r.index and 0 <= o.worker < workers
        assert o.hit_tokens % 512 == 0 and o.hit_tokens <= 512 * depth
        assert o.hit_tokens + o.prefill_tokens == r.num_prompt_tokens
        assert o.ttft_s >= o.prefill_tokens / 5000.0 - 1e-9
