"""The engine under hostile sampling values and failing requests: a request fails, not the loop."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from events.endpoints import Endpoint
from events.hashing import hash_blocks_sha256_cbor, wire_hash
from events.publisher import EventPublisher, PublisherConfig
from events.schema import BlockRemoved
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.worker.engine import Engine, EngineClosedError, InvalidRequestError, SamplingParams
from pool.worker.model import DecoderModel, ForwardItem, ModelConfig, greedy_reference
from pool.worker.outputs import RequestFailure, RequestOutput
from pool.worker.paged_cache import PagedKVCache
from tests.support.engine import BLOCK_SIZE, GREEDY, ListSink, Outputs
from tests.support.engine import make_engine as _engine
from tests.support.engine import run_until_idle as _run
from tests.support.engine import salted_prompt as _prompt

VOCAB = 258
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel(ModelConfig(seed=3))


def assert_pool_is_whole(engine: Engine) -> None:
    """Free + referenced blocks = capacity, the free queue holds exactly the free ones."""
    pool = engine.kv.block_pool
    referenced = [b for b in pool.blocks if b.ref_cnt > 0 and not b.is_null]
    queued = pool.free_block_queue.get_all_free_blocks()
    assert pool.get_num_free_blocks() + len(referenced) == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in queued)
    assert len(queued) == pool.get_num_free_blocks()


@pytest.mark.parametrize("tiny", [1e-40, 1e-300, 5e-324, 1e-3])
def test_a_tiny_positive_temperature_samples_at_the_floor(model: DecoderModel, tiny: float) -> None:
    """1e-40 used to overflow the softmax to NaN and kill the loop; now it is 0.01."""
    engine = _engine(model, 32)
    outputs = Outputs()
    for request_id, temperature in [("tiny", tiny), ("floor", 0.01)]:
        params = SamplingParams(max_tokens=6, temperature=temperature, seed=7, ignore_eos=True)
        engine.submit(request_id, _prompt(6, 1), params, outputs)
    _run(engine)
    assert outputs.last("tiny").finish_reason == "length"
    assert outputs.tokens("tiny") == outputs.tokens("floor")
    assert engine.stats().num_failures == {}


@pytest.mark.parametrize(
    ("params", "greedy"),
    [
        (SamplingParams(max_tokens=5, temperature=2.0, ignore_eos=True), False),
        (SamplingParams(max_tokens=5, temperature=1.0, top_k=1, ignore_eos=True), True),
        (SamplingParams(max_tokens=5, temperature=2.0, top_p=1e-300, ignore_eos=True), True),
        (SamplingParams(max_tokens=5, temperature=1.0, top_p=5e-324, ignore_eos=True), True),
        (SamplingParams(max_tokens=5, temperature=1.0, top_k=-1, seed=-1, ignore_eos=True), False),
        (SamplingParams(max_tokens=5, temperature=1.0, top_k=10**30, ignore_eos=True), False),
        (SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=40), False),
        (SamplingParams(max_tokens=5, temperature=1.0, seed=2**63 - 1, ignore_eos=True), False),
        (SamplingParams(max_tokens=5, temperature=1.0, seed=-(2**63), ignore_eos=True), False),
        (SamplingParams(max_tokens=5, temperature=0.0, seed=2**63 - 1, ignore_eos=True), True),
    ],
)  # fmt: skip
def test_sampling_edges_give_valid_tokens(
    model: DecoderModel, params: SamplingParams, greedy: bool
) -> None:
    engine = _engine(model, 32)
    outputs = Outputs()
    engine.submit("r", _prompt(7, 2), params, outputs)
    _run(engine)
    tokens = outputs.tokens("r")
    assert outputs.last("r").finish_reason == "length"
    assert len(tokens) == 5 and all(0 <= t < VOCAB for t in tokens)
    if greedy:  # top_k 1 and a top_p below the likeliest token's mass keep only it
        assert tokens == greedy_reference(model, _prompt(7, 2), 5)


def test_a_negative_seed_is_reproducible(model: DecoderModel) -> None:
    engine = _engine(model, 32)
    outputs = Outputs()
    for request_id, seed in [("a", -5), ("b", -5), ("other", 5)]:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
        engine.submit(request_id, _prompt(6, 1), params, outputs)
    _run(engine)
    assert len(outputs.tokens("a")) == 8
    assert outputs.tokens("a") == outputs.tokens("b") != outputs.tokens("other")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=math.nan), "temperature must be a finite number, got nan"),
        (SamplingParams(temperature=math.inf), "temperature must be a finite number, got inf"),
        (SamplingParams(temperature=2.5), "temperature must be at most 2.0, got 2.5"),
        (SamplingParams(temperature=1e308), "temperature must be at most 2.0"),
        (SamplingParams(temperature=-1e-40), "temperature must be >= 0"),
        (SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (SamplingParams(top_p=-0.1), r"top_p must be in \(0, 1\]"),
        (SamplingParams(top_p=1.0000001), r"top_p must be in \(0, 1\]"),
        (SamplingParams(top_p=math.nan), r"top_p must be in \(0, 1\], got nan"),
        (SamplingParams(top_k=-2), "top_k must be -1 or 0 .* or at least 1, got -2"),
        (SamplingParams(seed=2**63), r"signed 64-bit integer .* got 9223372036854775808"),
        (SamplingParams(seed=2**64), "seed must be a signed 64-bit integer"),
        (SamplingParams(seed=2**64 + 1), "seed must be a signed 64-bit integer"),
        (SamplingParams(seed=-(2**63) - 1), "seed must be a signed 64-bit integer"),
        (SamplingParams(max_tokens=-(2**70)), "max_tokens must be at least 1"),
        (SamplingParams(max_tokens=2**70), r"exceeds what this worker's KV cache can ever hold"),
    ],
)  # fmt: skip
def test_values_out_of_range_are_refused_with_the_range(
    model: DecoderModel, params: SamplingParams, message: str
) -> None:
    engine = _engine(model, 16)
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit("x", [1, 2], params, Outputs())
    assert not engine.has_work


def _poisoned(model: DecoderModel, token: int) -> DecoderModel:
    """``model`` with a corrupt embedding row (NaN) for ``token``, as a broken checkpoint has."""
    poisoned = DecoderModel(model.config)
    poisoned.load_state_dict(model.state_dict())
    with torch.no_grad():
        poisoned.embed.weight[token] = math.nan
    return poisoned


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_fail_that_request_and_the_others_go_on(
    model: DecoderModel, temperature: float
) -> None:
    good_prompt = _prompt(9, 2)
    reference = greedy_reference(model, good_prompt, 6)
    token = next(t for t in range(VOCAB) if t not in good_prompt + reference)
    poisoned = _poisoned(model, token)
    sink = ListSink()
    kv = KVCacheManager(KVCacheConfig(16, BLOCK_SIZE, enable_kv_cache_events=True))
    engine = Engine(poisoned, poisoned.make_cache(16, BLOCK_SIZE), kv, event_sink=sink)
    outputs = Outputs()
    bad_prompt = [*_prompt(8, 5), token]
    engine.submit("good", good_prompt, GREEDY, outputs)
    engine.submit("bad", bad_prompt, SamplingParams(temperature=temperature), outputs)
    _run(engine)
    assert outputs.tokens("good") == reference
    assert outputs.last("good").finish_reason == "length"
    bad = outputs.last("bad")
    assert (bad.finish_reason, bad.new_token_ids, bad.num_output_tokens) == ("error", [], 0)
    assert bad.failure is not None and bad.failure.stage == "sampling"
    assert "non-finite logits" in bad.failure.message
    assert engine.stats().num_failures == {"sampling": 1}
    assert_pool_is_whole(engine)
    assert engine.stats().num_free_blocks == 15
    # Its two full prompt blocks were cached when scheduled; they left the cache with it.
    bad_hashes = [wire_hash(d) for d in hash_blocks_sha256_cbor(bad_prompt, BLOCK_SIZE)]
    removed = [e.block_hashes[0] for e in sink.events if isinstance(e, BlockRemoved)]
    assert removed == bad_hashes
    engine.submit("after", good_prompt, SamplingParams(max_tokens=2, ignore_eos=True), outputs)
    _run(engine)
    assert outputs.tokens("after") == reference[:2]


MARKER = 250
"""A token whose forward pass raises in :class:`_RaisingModel`."""


class _RaisingModel(DecoderModel):
    """Fault injection: the forward pass raises whenever it computes :data:`MARKER`, as a
    device error or an allocation failure in one request's prefill would."""

    def forward_paged(self, items: list[ForwardItem], cache: PagedKVCache) -> torch.Tensor:  # type: ignore[override]
        if any(MARKER in item.token_ids for item in items):
            raise RuntimeError("injected device failure")
        return super().forward_paged(items, cache)


def test_a_forward_that_raises_fails_only_the_request_that_causes_it(
    model: DecoderModel,
) -> None:
    raising = _RaisingModel(model.config)
    raising.load_state_dict(model.state_dict())
    sink = ListSink()
    kv = KVCacheManager(KVCacheConfig(16, BLOCK_SIZE, enable_kv_cache_events=True))
    engine = Engine(raising, raising.make_cache(16, BLOCK_SIZE), kv, event_sink=sink)
    outputs = Outputs()
    prefix = _prompt(8, 5)
    engine.submit("good", _prompt(9, 2), GREEDY, outputs)
    engine.submit("bad", [*prefix, MARKER], GREEDY, outputs)
    engine.run_inbox(block=False)
    engine.step()  # one batch: it raises, then each request is computed alone
    failure = RequestFailure("forward", "RuntimeError: injected device failure")
    assert outputs.by_id["bad"] == [RequestOutput("bad", [], "error", 9, 0, 0, failure)]
    assert engine.stats().num_running == 1
    _run(engine)
    assert outputs.tokens("good") == greedy_reference(model, _prompt(9, 2), 6)
    assert engine.stats().num_failures == {"forward": 1}
    assert_pool_is_whole(engine)
    # The failed pass never wrote the bad prompt's K/V: a later request with its prefix
    # must not hit the blocks cached for it.
    engine.submit("probe", [*prefix, 1], SamplingParams(max_tokens=1), outputs)
    _run(engine)
    assert outputs.last("probe").num_cached_tokens == 0
    assert outputs.tokens("probe") == greedy_reference(model, [*prefix, 1], 1)


def test_a_sink_that_raises_loses_only_its_request(model: DecoderModel) -> None:
    engine = _engine(model, 16)
    outputs = Outputs()
    calls = []

    def broken(out: RequestOutput) -> None:
        calls.append(out)
        raise ConnectionError("the caller went away")

    engine.submit("broken", _prompt(6, 1), GREEDY, broken)
    engine.submit("fine", _prompt(6, 2), GREEDY, outputs)
    _run(engine)
    assert outputs.tokens("fine") == greedy_reference(model, _prompt(6, 2), 6)
    assert [out.finish_reason for out in calls] == [None, "error"]
    assert calls[-1].failure == RequestFailure("engine", "ConnectionError: the caller went away")
    assert engine.stats().num_failures == {"engine": 1}
    assert_pool_is_whole(engine)


def test_a_failing_loop_aborts_its_requests_and_refuses_new_ones(model: DecoderModel) -> None:
    """The publisher's thread died (its socket failed): publish raises, the loop ends."""
    publisher = EventPublisher(PublisherConfig(endpoint=Endpoint.binding("tcp://127.0.0.1:*")))
    publisher.close()
    kv = KVCacheManager(KVCacheConfig(16, BLOCK_SIZE, enable_kv_cache_events=True))
    engine = Engine(model, model.make_cache(16, BLOCK_SIZE), kv, event_sink=publisher)
    finished = threading.Event()
    outputs = Outputs()

    def sink(out: RequestOutput) -> None:
        outputs(out)
        if out.finished:
            finished.set()

    engine.start()
    engine.submit("a", _prompt(6, 1), GREEDY, sink)
    assert finished.wait(timeout=TIMEOUT_S)
    assert outputs.last("a").finish_reason == "abort"
    assert engine.join(timeout_s=TIMEOUT_S)
    assert not engine.is_accepting
    assert engine.failure is not None
    assert engine.failure.startswith("the engine loop failed: PublisherClosedError: ")
    with pytest.raises(EngineClosedError):
        engine.submit("b", _prompt(6, 1), GREEDY, sink)
    # Work queued for a loop that has ended fails at once instead of waiting forever.
    with pytest.raises(EngineClosedError, match="the engine loop has stopped"):
        engine.call(engine.stats).result(timeout=1)
