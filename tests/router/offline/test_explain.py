"""Explain: a prompt scored on a replayed index, the reason, and the router's own record."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from events.identity import WorkerId
from router.cli.explain import main as explain_main
from router.cli.explain import read_token_file
from router.index.memory import MemoryPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.load.model import WorkerLoad
from router.offline.explain import (
    RecordedCandidate,
    RecordedDecision,
    explain_request,
    find_decision,
)
from router.offline.replay import ReplayError, replay_log
from router.routing.cost import CostWeights
from tests.support.replay_log import BS, SCENARIO, TOKENS, write_log

W0, W1 = WorkerId("w0"), WorkerId("w1")
PROMPT = TOKENS[:22]  # five full blocks of four, and two tokens more


def _index(tmp_path: Path, at: float) -> BridgedIndex:
    index = BridgedIndex(MemoryPrefixIndex())
    asyncio.run(replay_log(write_log(tmp_path / "events.kvlog", SCENARIO), at, index))
    return index


def _recorded(worker: str, matched: dict[str, int], ts: float = 102.5) -> RecordedDecision:
    return RecordedDecision(
        ts=ts,
        worker_id=worker,
        policy="cache_aware",
        num_prompt_tokens=len(PROMPT),
        candidates=tuple(
            RecordedCandidate(w, m, m, WorkerLoad(), float(len(PROMPT) - m))
            for w, m in matched.items()
        ),
    )


def test_cache_aware_picks_the_longest_prefix_and_says_why(tmp_path: Path) -> None:
    index = _index(tmp_path, 102.0)  # w0 holds blocks 0-4, w1 blocks 0-1
    exp = asyncio.run(explain_request(index, PROMPT, [W0, W1], at_ts=102.0, block_size=BS))
    assert exp.decision.worker_id == W0
    assert [(c.worker_id, c.matched_tokens) for c in exp.decision.candidates] == [
        (W0, 20),
        (W1, 8),
    ]
    assert exp.costs[W0].cached_tokens == 20.0
    assert exp.costs[W0].prefill_tokens == 2.0
    assert exp.costs[W1].prefill_tokens == 14.0
    assert exp.reason.startswith(
        "cache_aware picks w0: the lowest cost, "
        f"{exp.costs[W0].score:,.0f} tokens of work. It caches 20 of the 22 prompt tokens, "
        "so it would compute 2; it has 0 prefill tokens queued, 0 decode tokens and 0 "
        "requests in flight. Next best: w1 at"
    )
    assert exp.agrees is None
    assert exp.disagreements == []


def test_recorded_loads_are_used_and_agreement_is_checked(tmp_path: Path) -> None:
    index = _index(tmp_path, 102.0)
    busy = RecordedDecision(
        ts=101.9,
        worker_id="w1",
        policy="cache_aware",
        num_prompt_tokens=len(PROMPT),
        candidates=(
            RecordedCandidate("w0", 20, 20, WorkerLoad(8, 4000, 64), 0.0),
            RecordedCandidate("w1", 8, 8, WorkerLoad(), 0.0),
        ),
    )
    exp = asyncio.run(
        explain_request(index, PROMPT, [W0, W1], at_ts=102.0, block_size=BS, recorded=busy)
    )
    # w0 holds more of the prompt but carries 4,000 queued tokens: w1 wins, as it did.
    assert exp.decision.worker_id == W1
    assert exp.costs[W0].queued_prefill_tokens == 4000
    assert exp.agrees is True

    stale = _recorded("w0", {"w0": 20, "w1": 4})
    exp = asyncio.run(
        explain_request(index, PROMPT, [W0, W1], at_ts=102.0, block_size=BS, recorded=stale)
    )
    assert exp.agrees is False
    assert exp.disagreements == ["w1: the router matched 4 tokens, the replayed index 8"]


def test_a_blind_policy_says_its_state_is_not_in_the_log(tmp_path: Path) -> None:
    index = _index(tmp_path, 102.0)
    exp = asyncio.run(
        explain_request(index, PROMPT, [W0, W1], at_ts=102.0, policy="round_robin", block_size=BS)
    )
    assert exp.costs == {}
    assert exp.reason.startswith("round_robin does not read the prefix index; on the replayed")


def test_find_decision_takes_the_last_one_of_that_length_not_after_the_moment() -> None:
    early = _recorded("w0", {}, ts=10.0)
    late = _recorded("w1", {}, ts=20.0)
    other = RecordedDecision(15.0, "w1", "cache_aware", 99)
    assert find_decision([early, other, late], 15.0, len(PROMPT)) == early
    assert find_decision([early, other, late], 25.0, len(PROMPT)) == late
    assert find_decision([early, late], 5.0, len(PROMPT)) is None


def test_token_files(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text("[1, 2, 3]")
    assert read_token_file(path) == [1, 2, 3]
    path.write_text("4 5,6\n7")
    assert read_token_file(path) == [4, 5, 6, 7]
    path.write_text("[1, -2]")
    with pytest.raises(ReplayError, match="non-negative"):
        read_token_file(path)
    path.write_text("a b")
    with pytest.raises(ReplayError, match="expected token ids"):
        read_token_file(path)


def test_cli_text_and_json_with_a_decision_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(tmp_path / "events.kvlog", SCENARIO)
    tokens = tmp_path / "prompt.json"
    tokens.write_text(json.dumps(PROMPT))
    decisions = tmp_path / "decisions.jsonl"
    record = {
        "ts": 102.5,
        "worker_id": "w0",
        "policy": "cache_aware",
        "num_prompt_tokens": len(PROMPT),
        "candidates": [
            {
                "worker_id": w,
                "matched_tokens": m,
                "predicted_tokens": m,
                "load": {"num_requests": 0, "queued_prefill_tokens": 0, "decode_tokens": 0},
                "score": 0.0,
            }
            for w, m in (("w0", 20), ("w1", 8))
        ],
    }
    decisions.write_text(json.dumps(record) + "\n")
    argv = [str(log), "--at", "102.5", "--tokens", str(tokens), "--decisions", str(decisions)]
    assert explain_main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("request: 22 prompt tokens (5 full blocks of 4); index replayed")
    assert out[2].split() == [
        "worker", "matched", "predicted", "requests", "queued", "decode", "score",
    ]  # fmt: skip
    assert out[3].split()[:6] == ["w0", "20", "20", "0", "0", "0"]
    assert out[3].endswith("<- picked")
    assert out[4].split()[:6] == ["w1", "8", "8", "0", "0", "0"]
    assert out[6].startswith("why: cache_aware picks w0")
    assert out[7].endswith("it chose w0 (cache_aware); the replayed state agrees.")

    assert explain_main([*argv, "--at", "103.0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["worker_id"] == "w0"
    assert [c["matched_tokens"] for c in data["candidates"]] == [20, 0]
    assert data["router"]["agrees"] is False
    assert data["router"]["disagreements"] == [
        "w1: the router matched 8 tokens, the replayed index 0"
    ]


def test_cli_text_prompt_and_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    log = write_log(tmp_path / "events.kvlog", SCENARIO)
    assert explain_main([str(log), "--prompt", "hello world, hello"]) == 0
    assert "request: 18 prompt tokens (4 full blocks of 4)" in capsys.readouterr().out
    assert explain_main([str(log), "--at", "50", "--prompt", "x"]) == 1
    assert "no worker has events" in caplog.text


def test_cli_scores_with_the_routers_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(tmp_path / "events.kvlog", SCENARIO)
    tokens = tmp_path / "prompt.txt"
    tokens.write_text(" ".join(map(str, PROMPT)))
    argv = [str(log), "--at", "102.0", "--tokens", str(tokens), "--json"]
    assert explain_main(argv) == 0
    default = json.loads(capsys.readouterr().out)
    per_token = CostWeights().prefill
    assert [c["score"] for c in default["candidates"]] == [2 * per_token, 14 * per_token]
    assert explain_main([*argv, "--router-args", "--prefill-weight 1 --policy least_loaded"]) == 0
    tuned = json.loads(capsys.readouterr().out)
    assert tuned["policy"] == "least_loaded"
    assert explain_main([*argv, "--router-args", "--prefill-weight 1"]) == 0
    assert [c["score"] for c in json.loads(capsys.readouterr().out)["candidates"]] == [2.0, 14.0]
