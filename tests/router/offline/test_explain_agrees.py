"""Explain shows the live decision's costs: same inputs, same decider, same figures.

The first test is end to end: a real router decides over a Redis index rebuilt from an
event log and writes its decision log; ``kvroute explain`` replays the same log and must
report, per candidate, exactly the scores and cost terms the router computed (three
workers, two sharing a system prompt the third lacks: the replicated-prefix term applies).
(``tests/router/test_decider.py`` checks the same agreement over random candidates.)
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec

from events.recorder import LogRecord
from events.schema import BlockStored, KVEventBatch, encode_batch
from router.cli.explain import main as explain_main
from router.front.config import RouterConfig
from router.front.service import RouterService
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.offline.explain import RecordedDecision
from router.offline.replay import REPLAY_LEASE_TTL_MS, redis_lease_taker, replay_log
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRegistry
from tests.support.chains import stored
from tests.support.replay_log import write_log
from tests.support.router_app import echo_workers

SYSTEM = list(range(1000, 1048))  # a three-block system prompt
PROMPT = SYSTEM + list(range(2000, 2040))  # plus a user turn: five full blocks and 8 tokens




def batch(ts: float, worker: str, seq: int, event: BlockStored) -> LogRecord:
    payload = encode_batch(KVEventBatch(ts=ts, events=[event]))
    return LogRecord(ts, worker, "batch", seq, payload)


def shared_prompt_log(path: Path, t0: float) -> Path:
    """w0 and w1 cache the system prompt (each with its own user turn); w2 lacks it."""
    return write_log(
        path,
        [
            batch(t0, "w0", 0, stored(SYSTEM + list(range(3000, 3032)), 0, 5)),
            batch(t0 + 0.1, "w1", 0, stored(SYSTEM + list(range(4000, 4016)), 0, 4)),
            batch(t0 + 0.2, "w2", 0, stored(list(range(5000, 5064)), 0, 4)),
        ],
    )


def test_explain_of_a_shared_system_prompt_reports_the_live_routers_costs(
    redis_url: str, namespace: str, tmp_path: Path, capsys: object
) -> None:
    log = shared_prompt_log(tmp_path / "events.kvlog", time.time() - 60.0)
    decisions = tmp_path / "decisions.jsonl"

    async def live() -> RecordedDecision:
        client = await connect(redis_url)
        layout = KeyLayout(namespace)
        try:
            # The index the router reads is the log replayed into its namespace; the replay
            # holds the workers' leases, so the router's ingest leaves those entries alone.
            index = BridgedIndex(RedisPrefixIndex(client, layout))
            registry = WorkerRegistry(client, layout, lease_ttl_ms=REPLAY_LEASE_TTL_MS)
            await replay_log(log, time.time(), index, redis_lease_taker(index, registry))
            async with echo_workers(3) as workers:
                for w in workers:
                    await registry.register(w.record())
                config = RouterConfig(
                    redis_url=redis_url, namespace=namespace, port=0, decision_log=str(decisions)
                )
                async with await RouterService.open(config) as service:
                    first = await service.decide(PROMPT, 4)
                    # The second decision also weighs the first: its predicted entry
                    # and the recent work it left on the chosen worker.
                    routed = await service.decide(PROMPT, 4)
        finally:
            stale = [key async for key in client.scan_iter(match=f"kvroute:{namespace}:*")]
            if stale:
                await client.delete(*stale)
            await client.aclose()
        decision = routed.decision
        assert [(c.worker_id, c.matched_tokens) for c in decision.candidates] == [
            ("w0", 48),
            ("w1", 48),
            ("w2", 0),
        ]
        assert decision.chosen.predicted_tokens == 80  # credited by the first decision
        assert 0.99 < decision.costs_by_worker()[first.decision.worker_id].recent_requests <= 1
        _, line = decisions.read_bytes().splitlines()
        return msgspec.json.decode(line, type=RecordedDecision)

    recorded = asyncio.run(live())
    tokens = tmp_path / "prompt.json"
    tokens.write_text(json.dumps(PROMPT))
    argv = [str(log), "--at", repr(recorded.ts), "--tokens", str(tokens), "--max-tokens", "4"]
    assert explain_main([*argv, "--decisions", str(decisions), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert shown["worker_id"] == recorded.worker_id
    assert shown["router"]["agrees"] is True
    assert [c["score"] for c in shown["candidates"]] == [c.score for c in recorded.candidates]
    assert [c["cost"] for c in shown["candidates"]] == [
        msgspec.to_builtins(c) for c in recorded.costs
    ]
    # w2 computes the system prompt too, but two others hold it: charged as replicated.
    assert recorded.costs[2].replicated_tokens == 48.0
    # The text form prints the same terms, and says what the replicated prefix cost w2.
    assert explain_main([*argv, "--decisions", str(decisions)]) == 0
    text = capsys.readouterr().out  # type: ignore[attr-defined]
    w2 = recorded.costs[2]
    assert f"{w2.score:,.1f}" in text
    assert "w2" in text and "replicated" in text
