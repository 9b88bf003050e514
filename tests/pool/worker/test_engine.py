"""Engine loop: admission, queueing, preemption, batching, events and snapshots, in process."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from events.hashing import hash_blocks_sha256_cbor, wire_hash
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.snapshot import CachedChains
from pool.worker.engine import (
    Engine,
    EngineClosedError,
    InvalidRequestError,
    SamplingParams,
)
from pool.worker.model import DecoderModel, ModelConfig, greedy_reference
from pool.worker.outputs import RequestOutput
from tests.support.engine import BLOCK_SIZE, GREEDY, ListSink, Outputs
from tests.support.engine import make_engine as _engine
from tests.support.engine import run_until_idle as _run
from tests.support.engine import salted_prompt as _prompt


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel(ModelConfig(seed=3))


def test_outputs_equal_the_no_cache_reference_under_memory_pressure(model: DecoderModel) -> None:
    # 15 usable blocks of 4 tokens; six requests need up to 6 blocks each, so the engine
    # queues, preempts and evicts, and prompts share prefixes.
    sink = ListSink()
    engine = _engine(model, 16, sink)
    outputs = Outputs()
    prompts = {f"r{i}": _prompt(8, 0)[: 4 + (i % 3) * 2] + _prompt(7 + i, i) for i in range(6)}
    for request_id, prompt in prompts.items():
        engine.submit(request_id, prompt, GREEDY, outputs)
    _run(engine)
    for request_id, prompt in prompts.items():
        assert outputs.tokens(request_id) == greedy_reference(model, prompt, 6), request_id
        assert outputs.last(request_id).finish_reason == "length"
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_usable_blocks == 15
    assert any(isinstance(e, BlockRemoved) for e in sink.events)


def test_cached_tokens_and_event_hashes_match_vllm(model: DecoderModel) -> None:
    sink = ListSink()
    engine = _engine(model, 32, sink)
    outputs = Outputs()
    prompt = _prompt(10, 1)
    engine.submit("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True), outputs)
    _run(engine)
    engine.submit("b", [*prompt, 7, 7], SamplingParams(max_tokens=1), outputs)
    _run(engine)
    assert outputs.last("a").num_cached_tokens == 0
    assert outputs.last("b").num_cached_tokens == 8
    # Request a: prompt blocks 0-1 at prefill, then block 2 once its generated tokens fill it.
    a_tokens = prompt + outputs.tokens("a")
    digests = hash_blocks_sha256_cbor(a_tokens, BLOCK_SIZE)
    stored = [e for e in sink.events if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored[:2]] == [
        [wire_hash(digests[0]), wire_hash(digests[1])],
        [wire_hash(digests[2])],
    ]
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == a_tokens[:8]
    assert stored[1].parent_block_hash == wire_hash(digests[1])
    assert stored[1].token_ids == a_tokens[8:12]
    assert all(e.block_size == BLOCK_SIZE and e.medium == "GPU" for e in stored)


def test_one_batch_per_step_with_events_and_evictions_first(model: DecoderModel) -> None:
    sink = ListSink()
    engine = _engine(model, 5, sink)  # 4 usable blocks
    outputs = Outputs()
    engine.submit("a", _prompt(9, 1), SamplingParams(max_tokens=1), outputs)
    _run(engine)
    engine.submit("b", _prompt(9, 2), SamplingParams(max_tokens=1), outputs)
    steps = _run(engine)
    assert steps == 1
    last = sink.batches[-1].events
    # Free queue after a: its uncached 3rd block, the never-used block, then a's cached
    # blocks tail first. b takes three blocks, so a's 2nd block is evicted, and that
    # eviction precedes the store of b's two full blocks in the same batch.
    a_hashes = [wire_hash(d) for d in hash_blocks_sha256_cbor(_prompt(9, 1), BLOCK_SIZE)]
    b_hashes = [wire_hash(d) for d in hash_blocks_sha256_cbor(_prompt(9, 2), BLOCK_SIZE)]
    assert last == [
        BlockRemoved(block_hashes=[a_hashes[1]], medium="GPU", group_idx=0),
        BlockStored(
            block_hashes=b_hashes,
            parent_block_hash=None,
            token_ids=_prompt(8, 2),
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None, None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
    ]
    assert len(sink.batches) == 2
    assert all(b.data_parallel_rank is None for b in sink.batches)


def test_a_request_that_does_not_fit_waits_for_blocks(model: DecoderModel) -> None:
    engine = _engine(model, 7)  # 6 usable blocks = 24 tokens
    outputs = Outputs()
    engine.submit("big", _prompt(17, 1), SamplingParams(max_tokens=3, ignore_eos=True), outputs)
    engine.submit("next", _prompt(9, 2), SamplingParams(max_tokens=2, ignore_eos=True), outputs)
    engine.run_inbox(block=False)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert (stats.queued_prefill_tokens, stats.decode_tokens) == (9, (3 - 1) + 2)
    _run(engine)
    assert outputs.tokens("next") == greedy_reference(model, _prompt(9, 2), 2)
    assert outputs.tokens("big") == greedy_reference(model, _prompt(17, 1), 3)


def test_snapshot_equals_what_the_events_imply(model: DecoderModel) -> None:
    sink = ListSink()
    engine = _engine(model, 12, sink)
    outputs = Outputs()
    for i in range(5):
        engine.submit(f"r{i}", _prompt(6 + 3 * i, i % 2), GREEDY, outputs)
    _run(engine)
    replayed = CachedChains(BLOCK_SIZE)
    replayed.apply(sink.events)  # type: ignore[arg-type]
    snapshot = engine.snapshot()
    assert snapshot.next_seq == len(sink.batches)
    assert snapshot.runs == replayed.runs()
    pool_truth = {
        wire_hash(b.block_hash) for b in engine.kv.block_pool.blocks if b.block_hash is not None
    }
    assert {h for run in snapshot.runs for h in run["block_hashes"]} == pool_truth


def test_reset_prefix_cache_only_when_idle(model: DecoderModel) -> None:
    sink = ListSink()
    engine = _engine(model, 16, sink)
    outputs = Outputs()
    engine.submit("a", _prompt(9, 1), SamplingParams(max_tokens=4, ignore_eos=True), outputs)
    engine.run_inbox(block=False)
    engine.step()
    assert engine.reset_prefix_cache() is False
    _run(engine)
    assert engine.reset_prefix_cache() is True
    assert isinstance(sink.events[-1], AllBlocksCleared)
    assert engine.snapshot().runs == []
    engine.submit("b", _prompt(9, 1), SamplingParams(max_tokens=1), outputs)
    _run(engine)
    assert outputs.last("b").num_cached_tokens == 0


def test_abort_frees_blocks_and_reports_abort(model: DecoderModel) -> None:
    engine = _engine(model, 16)
    outputs = Outputs()
    engine.submit("a", _prompt(9, 1), SamplingParams(max_tokens=50, ignore_eos=True), outputs)
    engine.submit("b", _prompt(9, 2), SamplingParams(max_tokens=50, ignore_eos=True), outputs)
    engine.run_inbox(block=False)
    engine.step()
    engine.abort("a")
    engine.abort("missing")
    engine.run_inbox(block=False)
    assert outputs.last("a").finish_reason == "abort"
    assert engine.stats().num_running == 1
    engine.abort("b")
    engine.run_inbox(block=False)
    assert engine.stats().num_free_blocks == 15
    assert not engine.has_work


def test_eos_stops_unless_ignored(model: DecoderModel) -> None:
    prompt = _prompt(5, 3)
    reference = greedy_reference(model, prompt, 8)
    eos = reference[2]
    kv = KVCacheManager(KVCacheConfig(16, BLOCK_SIZE))
    engine = Engine(model, model.make_cache(16, BLOCK_SIZE), kv, eos_token_id=eos)
    outputs = Outputs()
    engine.submit("stop", prompt, SamplingParams(max_tokens=8), outputs)
    engine.submit("go", prompt, SamplingParams(max_tokens=8, ignore_eos=True), outputs)
    _run(engine)
    assert outputs.tokens("stop") == reference[: reference.index(eos) + 1]
    assert outputs.last("stop").finish_reason == "stop"
    assert outputs.tokens("go") == reference


def test_seeded_sampling_is_reproducible(model: DecoderModel) -> None:
    engine = _engine(model, 32)
    outputs = Outputs()
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    engine.submit("a", _prompt(6, 1), params, outputs)
    engine.submit("b", _prompt(6, 1), params, outputs)
    _run(engine)
    assert outputs.tokens("a") == outputs.tokens("b")
    assert outputs.tokens("a") != greedy_reference(model, _prompt(6, 1), 8)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_a_small_token_budget_gives_the_reference_outputs(
    model: DecoderModel, chunked: bool
) -> None:
    engine = _engine(model, 32, max_num_batched_tokens=5, enable_chunked_prefill=chunked)
    outputs = Outputs()
    prompts = {f"r{i}": _prompt(3 + 4 * i, i) for i in range(4)}
    for request_id, prompt in prompts.items():
        engine.submit(request_id, prompt, SamplingParams(max_tokens=4, ignore_eos=True), outputs)
    _run(engine)
    for request_id, prompt in prompts.items():
        assert outputs.tokens(request_id) == greedy_reference(model, prompt, 4), request_id


def test_token_budget_splits_prefills_across_steps(model: DecoderModel) -> None:
    engine = _engine(model, 32, max_num_batched_tokens=10)
    outputs = Outputs()
    for i in range(3):
        engine.submit(f"r{i}", _prompt(8, i), SamplingParams(max_tokens=1), outputs)
    engine.run_inbox(block=False)
    engine.step()
    assert sorted(outputs.by_id) == ["r0"]
    _run(engine)
    assert sorted(outputs.by_id) == ["r0", "r1", "r2"]


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "the prompt is empty"),
        ([1, 300], GREEDY, r"token ids must be in \[0, 258\), got \[300\]"),
        ([1], SamplingParams(max_tokens=0), "max_tokens must be at least 1, got 0"),
        ([1], SamplingParams(temperature=-1.0), "temperature must be >= 0"),
        (list(range(60)), GREEDY, r"= 66 tokens exceeds .* \(60\); shorten the prompt"),
    ],
)
def test_requests_that_can_never_run_are_rejected(
    model: DecoderModel, prompt: list[int], params: SamplingParams, message: str
) -> None:
    engine = _engine(model, 16)
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit("x", prompt, params, Outputs())


def test_dropped_batches_are_counted(model: DecoderModel) -> None:
    sink = ListSink(accept=False)
    engine = _engine(model, 16, sink)
    engine.submit("a", _prompt(9, 1), SamplingParams(max_tokens=1), Outputs())
    _run(engine)
    stats = engine.stats()
    assert (stats.num_batches_published, stats.num_batches_dropped) == (0, 1)


@pytest.fixture
def threaded(model: DecoderModel) -> Iterator[Engine]:
    engine = _engine(model, 16)
    engine.start()
    yield engine
    assert engine.stop(timeout_s=60)


def test_thread_drains_queued_work_then_refuses_new(threaded: Engine, model: DecoderModel) -> None:
    done = threading.Event()
    outputs = Outputs()

    def sink(out: RequestOutput) -> None:
        outputs(out)
        if out.finished:
            done.set()

    threaded.submit("a", _prompt(6, 1), GREEDY, sink)
    assert threaded.call(lambda: 41 + 1).result(timeout=60) == 42
    threaded.drain()
    assert done.wait(timeout=60)
    assert outputs.tokens("a") == greedy_reference(model, _prompt(6, 1), 6)
    with pytest.raises(EngineClosedError, match="shutting down"):
        threaded.submit("b", _prompt(6, 1), GREEDY, sink)
