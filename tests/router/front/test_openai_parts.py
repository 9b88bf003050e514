"""The router's OpenAI pieces without a socket: the token cache, tokenizer sources, asking
a stream for its usage, batch merging, the worker models table."""

from __future__ import annotations

import json

import msgspec
import pytest

from router.front.batch import merge_answers
from router.front.engine_tokenizer import TokenCache
from router.front.stream_usage import UsageStripper, ask_for_usage
from router.front.tokenization import TokenizerSources
from router.workers.models import ModelNotFoundError, ModelRequiredError, WorkerModels
from router.workers.registry import WorkerRecord


def test_the_token_cache_evicts_the_least_recently_used_within_its_token_bound() -> None:
    cache = TokenCache(max_tokens=10)
    cache.put(b"a", [1, 2, 3, 4])
    cache.put(b"b", [5, 6, 7])
    assert cache.get(b"a") == [1, 2, 3, 4]  # now the most recently used
    cache.put(b"c", [8, 9, 10, 11])  # 11 tokens held: b must go
    assert (cache.get(b"b"), len(cache), cache.num_tokens) == (None, 2, 8)
    cache.put(b"a", [1])  # replaced, not added
    assert cache.num_tokens == 5
    cache.put(b"huge", list(range(11)))  # longer than the bound: not kept
    assert (cache.get(b"huge"), cache.num_tokens) == (None, 5)


def test_tokenizer_sources_prefer_a_models_own_setting() -> None:
    sources = TokenizerSources.from_flags(["/all", "qwen=/qwen"], ["llama"])
    assert [sources.source(m) for m in ("qwen", "llama", "other", None)] == [
        "/qwen", "engine", "/all", "/all",
    ]  # fmt: skip
    assert TokenizerSources().source("x") is None
    engine_default = TokenizerSources.from_flags(["qwen=/qwen"], [""])
    assert [engine_default.source(m) for m in ("qwen", "x")] == ["/qwen", "engine"]


def test_asking_for_usage_changes_only_that() -> None:
    raw = b' {  "prompt" : "x",\n "stream": true }'
    assert (
        ask_for_usage(raw)
        == b' {"stream_options":{"include_usage":true},  "prompt" : "x",\n "stream": true }'
    )
    asked = b'{"stream": true, "stream_options": {"include_usage": true}}'
    assert ask_for_usage(asked, {"include_usage": True}) is asked
    merged = ask_for_usage(b'{"stream": true, "stream_options": {"x": 1}}', {"x": 1})
    assert json.loads(merged) == {"stream": True, "stream_options": {"x": 1, "include_usage": True}}


def test_the_usage_stripper_drops_the_usage_chunk_and_the_nulls() -> None:
    strip = UsageStripper()
    assert strip.rewrite_event(b"[DONE]") == b"[DONE]"
    assert strip.rewrite_event(b'{"choices": [{"text": "a"}]}') == b'{"choices": [{"text": "a"}]}'
    assert strip.rewrite_event(b'{"choices": [], "usage": {"prompt_tokens": 1}}') is None
    kept = strip.rewrite_event(b'{"choices": [{"text": "a"}], "usage": null}')
    assert kept is not None and msgspec.json.decode(kept) == {"choices": [{"text": "a"}]}


def test_batch_answers_merge_in_prompt_order() -> None:
    answers = [
        {"id": "cmpl-1", "choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}],
         "usage": {"prompt_tokens": 2, "completion_tokens": 2,
                   "prompt_tokens_details": {"cached_tokens": 1}}},
        {"id": "cmpl-2", "choices": [{"index": 1, "text": "d"}, {"index": 0, "text": "c"}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                   "prompt_tokens_details": {"cached_tokens": 0}}},
    ]  # fmt: skip
    merged = merge_answers(answers, n=2)
    assert merged["id"] == "cmpl-1"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a"), (1, "b"), (3, "d"), (2, "c"),
    ]  # fmt: skip
    assert merged["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 1},
    }  # fmt: skip


def _record(worker_id: str, models: tuple[str, ...] = ()) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id, events_endpoint="tcp://127.0.0.1:1", http_url="http://h:1",
        served_models=models,
    )  # fmt: skip


def test_worker_models_select_the_workers_of_a_model() -> None:
    models = WorkerModels()
    a, b, c = _record("a"), _record("b", ("named",)), _record("c")
    models.learn(a.worker_id, [{"id": "x", "owned_by": "vllm", "max_model_len": 8}])  # type: ignore[arg-type]
    assert models.of(c) is None  # not learned yet
    assert models.select([a, b, c], "x") == ("x", [a])
    assert models.select([a, b, c], "named") == ("named", [b])
    assert models.select([a, b, c], "y") == ("y", [c])  # only c may serve it
    with pytest.raises(ModelRequiredError):
        models.select([a, b, c], None)
    models.learn(c.worker_id, [])  # c serves nothing
    with pytest.raises(ModelNotFoundError, match="The model `y` does not exist"):
        models.select([a, b, c], "y")
    assert models.select([a], None) == ("x", [a])
    models.learn(a.worker_id, None)  # no answer: what was learned stays
    assert models.of(a) == ("x",)
    assert [e["id"] for e in models.listing([a, b, c])] == ["x", "named"]
    assert models.listing([a])[0]["max_model_len"] == 8
    models.forget(a.worker_id)
    assert models.of(a) is None
