"""Random workloads under memory pressure: no lost or corrupted KV, no leaked blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import wire_hash
from events.schema import KVEventBatch
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.snapshot import CachedChains
from pool.worker.engine import Engine, EngineConfig, SamplingParams
from pool.worker.model import DecoderModel, ModelConfig, greedy_reference
from pool.worker.outputs import RequestOutput

pytestmark = pytest.mark.slow

BLOCK_SIZE = 2
VOCAB = 24
MODEL = DecoderModel(ModelConfig(vocab_size=VOCAB, num_layers=1, hidden_size=16, num_heads=2))


class _Sink:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> bool:
        self.batches.append(batch)
        return True


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_random_workloads_match_the_reference_and_free_every_block(data: st.DataObject) -> None:
    num_blocks = data.draw(st.integers(5, 12), label="num_blocks")
    capacity = (num_blocks - 1) * BLOCK_SIZE
    sink = _Sink()
    kv = KVCacheManager(KVCacheConfig(num_blocks, BLOCK_SIZE, enable_kv_cache_events=True))
    config = EngineConfig(
        max_num_batched_tokens=data.draw(st.integers(2, 24), label="budget"),
        enable_chunked_prefill=data.draw(st.booleans(), label="chunked"),
    )
    engine = Engine(MODEL, MODEL.make_cache(num_blocks, BLOCK_SIZE), kv, config, event_sink=sink)
    stems = [[(7 * s + i) % VOCAB for i in range(6)] for s in range(3)]  # shared prefixes
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    requests: dict[str, tuple[list[int], int]] = {}

    def sink_output(out: RequestOutput) -> None:
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finished[out.request_id] = str(out.finish_reason)

    for index in range(data.draw(st.integers(1, 8), label="num_requests")):
        stem = data.draw(st.sampled_from(stems))
        suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=4))
        prompt = (stem[: data.draw(st.integers(1, 6))] + suffix)[: capacity - 1]
        max_tokens = data.draw(st.integers(1, min(10, capacity - len(prompt))))
        request_id = f"r{index}"
        requests[request_id] = (prompt, max_tokens)
        engine.submit(request_id, prompt, SamplingParams(max_tokens=max_tokens), sink_output)
        if data.draw(st.integers(0, 3), label="abort") == 0:  # maybe one running already
            engine.abort(data.draw(st.sampled_from(sorted(requests)), label="aborted"))
        engine.run_inbox(block=False)
        for _ in range(data.draw(st.integers(0, 2), label="steps")):
            if engine.has_work:
                engine.step()
    engine.run_inbox(block=False)
    while engine.has_work:
        engine.step()

    assert sorted(finished) == sorted(requests)
    for request_id, (prompt, max_tokens) in requests.items():
        if finished[request_id] != "abort":
            assert finished[request_id] == "length"
            assert outputs[request_id] == greedy_reference(MODEL, prompt, max_tokens)
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == num_blocks - 1
    cached = {wire_hash(b.block_hash) for b in pool.blocks if b.block_hash is not None}
    implied = CachedChains(BLOCK_SIZE)
    implied.apply(e for batch in sink.batches for e in batch.events)
    assert implied.block_hashes == cached
    assert engine.snapshot().runs == implied.runs()
