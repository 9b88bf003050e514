"""Scheduler: admission order, token budget and preemption, exactly (no model involved)."""

from __future__ import annotations

from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.worker.scheduler import Scheduled, Scheduler


def _scheduler(num_blocks: int, budget: int = 1000, chunked: bool = True) -> Scheduler[Scheduled]:
    kv = KVCacheManager(KVCacheConfig(num_blocks, block_size=2))
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, chunked_prefill=chunked)


def _entry(scheduler: Scheduler[Scheduled], request_id: str, num_tokens: int) -> Scheduled:
    first = 100 * (ord(request_id[0]) - ord("a"))
    request = scheduler.kv.make_request(request_id, range(first, first + num_tokens))
    entry = Scheduled(request)
    scheduler.add(entry)
    return entry


def _finish_step(scheduled: list[Scheduled]) -> None:
    """What the engine does after the forward pass: tokens computed, one token sampled."""
    for entry in scheduled:
        entry.request.num_computed_tokens += entry.num_scheduled_tokens
        entry.request.append_output_token_ids(7)


def _ids(entries: list[Scheduled]) -> list[str]:
    return [e.request.request_id for e in entries]


def test_a_decode_that_cannot_grow_preempts_the_newest_request() -> None:
    scheduler = _scheduler(num_blocks=5)  # 4 usable blocks of 2 tokens
    a = _entry(scheduler, "a", 3)
    b = _entry(scheduler, "b", 3)
    step = scheduler.schedule()
    assert (_ids(step), [e.num_scheduled_tokens for e in step]) == (["a", "b"], [3, 3])
    _finish_step(step)
    step = scheduler.schedule()  # 4th token of each still fits their 2nd block
    assert _ids(step) == ["a", "b"]
    _finish_step(step)
    c = _entry(scheduler, "c", 1)
    step = scheduler.schedule()  # a needs a 3rd block: b (newest) is preempted for it
    assert _ids(step) == ["a"]
    assert _ids(list(scheduler.waiting)) == ["b", "c"]  # no admission in a preempting step
    assert (b.request.num_computed_tokens, scheduler.num_preemptions) == (0, 1)
    assert scheduler.kv.get_block_ids("b") == []
    _finish_step(step)
    scheduler.finish(a)
    step = scheduler.schedule()  # b is recomputed first, its 5 tokens minus the cached prefix
    assert _ids(step) == ["b", "c"]
    # b's first block is a hit; num_cached_tokens keeps the first admission's figure.
    assert (b.num_cached_tokens, b.num_scheduled_tokens) == (0, 3)
    assert (c.num_cached_tokens, c.num_scheduled_tokens) == (0, 1)
    assert (scheduler.prefix_query_tokens, scheduler.prefix_hit_tokens) == (3 + 3 + 5 + 1, 2)


def test_the_newest_request_preempts_itself_when_it_cannot_grow() -> None:
    scheduler = _scheduler(num_blocks=4)  # 3 usable blocks
    a = _entry(scheduler, "a", 3)  # 2 blocks, room for its 4th token
    b = _entry(scheduler, "b", 2)  # 1 block, full
    _finish_step(scheduler.schedule())
    step = scheduler.schedule()  # a fits; b needs a 2nd block, and b is the newest
    assert _ids(step) == ["a"]
    assert (_ids(list(scheduler.waiting)), scheduler.num_preemptions) == (["b"], 1)
    assert b.request.output_token_ids == [7]  # kept: recomputed on readmission
    _finish_step(step)
    scheduler.finish(a)
    step = scheduler.schedule()
    assert (_ids(step), b.num_scheduled_tokens) == (["b"], 1)  # block 0 is a hit


def test_queued_prefill_counts_the_cache_misses_of_waiting_requests() -> None:
    scheduler = _scheduler(num_blocks=5)  # 4 usable blocks
    a = _entry(scheduler, "a", 5)
    _finish_step(scheduler.schedule())
    scheduler.finish(a)  # its 2 full blocks (tokens 0-3) stay cached in the free queue
    shared = Scheduled(scheduler.kv.make_request("s", [*range(4), 50, 51, 52]))
    other = Scheduled(scheduler.kv.make_request("o", [60, 61, 62]))
    scheduler.add(shared)
    scheduler.add(other)
    assert scheduler.queued_prefill_tokens == (7 - 4) + 3


def test_without_chunking_the_budget_caps_admission_and_a_long_prompt_runs_alone() -> None:
    scheduler = _scheduler(num_blocks=40, budget=4, chunked=False)
    _entry(scheduler, "a", 3)
    _entry(scheduler, "b", 3)
    assert _ids(scheduler.schedule()) == ["a"]
    scheduler = _scheduler(num_blocks=40, budget=4, chunked=False)
    _entry(scheduler, "c", 9)
    assert [e.num_scheduled_tokens for e in scheduler.schedule()] == [9]


def test_chunked_prefill_fills_the_budget_and_decodes_go_first() -> None:
    scheduler = _scheduler(num_blocks=40, budget=4)
    a = _entry(scheduler, "a", 3)
    c = _entry(scheduler, "c", 9)
    plan = [(e.request.request_id, e.num_scheduled_tokens) for e in scheduler.schedule()]
    assert plan == [("a", 3), ("c", 1)]
    _finish_step([a])  # a's prompt is done: it samples; c's 1-token chunk samples nothing
    c.request.num_computed_tokens += 1
    for expected in ([("a", 1), ("c", 3)], [("a", 1), ("c", 3)], [("a", 1), ("c", 2)]):
        plan = [(e.request.request_id, e.num_scheduled_tokens) for e in scheduler.schedule()]
        assert plan == expected
        _finish_step([a])
        c.request.num_computed_tokens += plan[1][1]
    assert c.request.num_computed_tokens == c.request.num_tokens == 9
    assert len(scheduler.kv.get_block_ids("c")) == 5
    assert scheduler.queued_prefill_tokens == 0


def test_remove_takes_a_request_out_of_either_queue() -> None:
    scheduler = _scheduler(num_blocks=3)  # 2 usable blocks: b must wait
    _entry(scheduler, "a", 3)
    _entry(scheduler, "b", 3)
    assert _ids(scheduler.schedule()) == ["a"]
    assert scheduler.remove("b") is not None
    assert scheduler.remove("a") is not None
    assert scheduler.remove("a") is None
    assert not scheduler.has_work
    assert scheduler.kv.block_pool.get_num_free_blocks() == 2
