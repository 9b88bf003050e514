"""The worker's OpenAI surface over real HTTP: models, n, stop, seed, logprobs, batches, usage
in streams, chat, cache salts, /tokenize and /detokenize."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from events.chat_template import BuiltinChatTemplate
from events.tokenizer import ByteTokenizer
from pool.worker.model import DecoderModel, ModelConfig, greedy_reference
from tests.support.workers import JSON_HEADERS, TIMEOUT_S, RunningWorker
from tests.support.workers import get_body as _get
from tests.support.workers import post_json as _post
from tests.support.workers import start_worker as _start_worker
from tests.support.workers import worker_config as _config

TOK = ByteTokenizer()
NUM_BLOCKS = 40  # 39 usable blocks of 4 tokens: requests reach 156 tokens


@pytest.fixture(scope="module")
def worker() -> Iterator[RunningWorker]:
    running = _start_worker(_config(NUM_BLOCKS, served_model_name=("tiny", "alias")))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel(ModelConfig(seed=5))


def _complete(worker: RunningWorker, path: str = "/v1/completions", **body: Any) -> Any:
    status, reply = _post(f"{worker.http}{path}", body)
    assert status == 200, reply
    return reply


def _stream(worker: RunningWorker, path: str, body: dict[str, Any]) -> list[Any]:
    host, port = worker.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    conn.request("POST", path, json.dumps({**body, "stream": True}), JSON_HEADERS)
    response = conn.getresponse()
    assert response.status == 200
    events = [e for e in response.read().decode().split("\n\n") if e]
    conn.close()
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_models_lists_the_served_names(worker: RunningWorker) -> None:
    status, raw = _get(f"{worker.http}/v1/models")
    assert status == 200
    listing = json.loads(raw)
    assert listing["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["root"]) for m in listing["data"]] == [
        ("tiny", "model", "kvroute", "tiny"),
        ("alias", "model", "kvroute", "tiny"),
    ]
    assert {m["max_model_len"] for m in listing["data"]} == {156}


def test_an_unknown_model_gets_openais_404_and_a_named_one_is_echoed(
    worker: RunningWorker,
) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "model": "tinny"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "model": "tinny"}),
        ("/tokenize", {"prompt": "hi", "model": "tinny"}),
    ):  # fmt: skip
        status, reply = _post(f"{worker.http}{path}", body)
        assert (status, reply) == (
            404,
            {
                "error": {
                    "message": "The model `tinny` does not exist. This worker serves: tiny, alias",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "model_not_found",
                }
            },
        )
    assert _complete(worker, prompt="hi", max_tokens=1, model="alias")["model"] == "alias"
    assert _complete(worker, prompt="hi", max_tokens=1)["model"] == "tiny"  # none named


def test_unsupported_parameters_are_refused_naming_them(worker: RunningWorker) -> None:
    status, reply = _post(
        f"{worker.http}/v1/completions", {"prompt": "hi", "presence_penalty": 1.0}
    )
    assert status == 400
    assert reply["error"]["param"] == "presence_penalty"
    assert reply["error"]["type"] == "invalid_request_error"
    status, reply = _post(f"{worker.http}/v1/completions", {"prompt": "hi", "mystery": 1})
    assert (status, reply["error"]["param"]) == (400, "mystery")
    # Harmless values pass.
    _complete(worker, prompt="hi", max_tokens=1, presence_penalty=0, user="u")


def test_streams_carry_usage_only_when_asked(worker: RunningWorker) -> None:
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "ignore_eos": True}
    plain = _stream(worker, "/v1/completions", body)
    assert len(plain) == 3
    assert not any("usage" in c for c in plain)
    counted = _stream(
        worker, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert [c["usage"] for c in counted[:-1]] == [None] * 3
    assert counted[-1]["choices"] == []
    assert counted[-1]["id"] == counted[0]["id"]
    usage = counted[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 3, 8)


def test_n_choices_sample_apart_and_a_seed_repeats_them(worker: RunningWorker) -> None:
    body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    two = _complete(worker, **body, n=2, seed=11)
    assert [c["index"] for c in two["choices"]] == [0, 1]
    texts = [c["token_ids"] for c in two["choices"]]
    assert texts[0] != texts[1]
    assert _complete(worker, **body, n=2, seed=11)["choices"] == two["choices"]
    # Choice i samples with seed + i: the same as a one-choice request with that seed.
    assert _complete(worker, **body, seed=11)["choices"][0]["token_ids"] == texts[0]
    assert _complete(worker, **body, seed=12)["choices"][0]["token_ids"] == texts[1]
    assert two["usage"]["completion_tokens"] == 16
    assert two["usage"]["prompt_tokens"] == 9


def test_streamed_choices_are_indexed(worker: RunningWorker) -> None:
    chunks = _stream(
        worker,
        "/v1/completions",
        {"prompt": "ab", "max_tokens": 2, "n": 2, "seed": 1, "temperature": 1, "ignore_eos": True},
    )
    by_choice: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_choice[choice["index"]] += choice["token_ids"]
    assert [len(ids) for ids in by_choice.values()] == [2, 2]


def test_a_stop_string_ends_the_choice(worker: RunningWorker, model: DecoderModel) -> None:
    prompt = list(b"The stop test: ")
    reference = TOK.decode(greedy_reference(model, prompt, 24))
    # The first character that is not a broken byte and not seen before stops the text.
    at = next(
        i for i, ch in enumerate(reference) if i > 0 and ch != "\ufffd" and ch not in reference[:i]
    )
    body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "stop": [reference[at]]}
    (choice,) = _complete(worker, **body)["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        reference[:at],
        "stop",
        reference[at],
    )
    streamed = _stream(worker, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in streamed) == reference[:at]
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_logprobs_are_the_models(worker: RunningWorker, model: DecoderModel) -> None:
    prompt = [10, 20, 30, 40, 50]
    body = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "logprobs": 2}
    (choice,) = _complete(worker, **body)["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 3
    expected = torch.log_softmax(model.forward_dense(prompt)[-1].float(), -1)
    first = choice["token_ids"][0]
    assert logprobs["token_logprobs"][0] == pytest.approx(float(expected[first]), abs=1e-4)
    # The sampled token, then the 2 likeliest: greedy sampled the likeliest, one entry.
    top2 = torch.topk(expected, 2)
    assert list(logprobs["top_logprobs"][0].values()) == pytest.approx(
        top2.values.tolist(), abs=1e-4
    )
    # Offsets: where each token's text starts (tokens are decoded alone, as vLLM does).
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [0, lengths[0], lengths[0] + lengths[1]]
    (plain,) = _complete(worker, prompt=prompt, max_tokens=1)["choices"]
    assert plain["logprobs"] is None


def test_a_batch_prompt_gets_one_choice_per_prompt_in_order(worker: RunningWorker) -> None:
    prompts = ["first prompt", "second one"]
    batch = _complete(worker, prompt=prompts, max_tokens=3, ignore_eos=True)
    alone = [_complete(worker, prompt=p, max_tokens=3, ignore_eos=True) for p in prompts]
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["token_ids"] for c in batch["choices"]] == [
        a["choices"][0]["token_ids"] for a in alone
    ]
    assert batch["usage"]["prompt_tokens"] == len("first prompt") + len("second one")


def test_chat_completions_render_the_template(worker: RunningWorker, model: DecoderModel) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    answer = _complete(
        worker, "/v1/chat/completions", messages=messages, max_tokens=4, ignore_eos=True,
        logprobs=True, top_logprobs=1,
    )  # fmt: skip
    assert answer["id"].startswith("chatcmpl-")
    assert answer["object"] == "chat.completion"
    prompt = TOK.encode(BuiltinChatTemplate().render(messages))
    (choice,) = answer["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": TOK.decode(greedy_reference(model, prompt, 4)),
    }
    assert len(choice["logprobs"]["content"]) == 4
    assert all(len(e["top_logprobs"]) == 1 for e in choice["logprobs"]["content"])
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    chunks = _stream(
        worker, "/v1/chat/completions",
        {"messages": messages, "max_tokens": 2, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_a_cache_salt_separates_cached_prefixes(worker: RunningWorker) -> None:
    prompt = "salted prefix, twelve+ tokens"
    first = _complete(worker, prompt=prompt, max_tokens=1, cache_salt="tenant-a")
    assert first["usage"]["cached_tokens"] == 0
    again = _complete(worker, prompt=prompt, max_tokens=1, cache_salt="tenant-a")
    assert again["usage"]["cached_tokens"] == 28  # every full block of 4 but the last token's
    other = _complete(worker, prompt=prompt, max_tokens=1, cache_salt="tenant-b")
    assert other["usage"]["cached_tokens"] == 0


def test_tokenize_and_detokenize_in_vllms_shape(worker: RunningWorker) -> None:
    assert _complete(worker, "/tokenize", prompt="héllo") == {
        "count": 6,
        "max_model_len": 156,
        "tokens": list("héllo".encode()),
        "token_strs": None,
    }
    messages = [{"role": "user", "content": "hi"}]
    chat = _complete(worker, "/tokenize", messages=messages, model="alias")
    assert chat["tokens"] == TOK.encode(BuiltinChatTemplate().render(messages))
    bare = _complete(worker, "/tokenize", messages=messages, add_generation_prompt=False)
    assert bare["tokens"] == list(b"<|user|>\nhi\n")
    strs = _complete(worker, "/tokenize", prompt="ab", return_token_strs=True)
    assert strs["token_strs"] == ["a", "b"]
    assert _complete(worker, "/detokenize", tokens=list("héllo".encode())) == {"prompt": "héllo"}
    status, reply = _post(f"{worker.http}/detokenize", {"tokens": [1, 999]})
    assert (status, reply["error"]["param"]) == (400, "tokens")
    status, reply = _post(f"{worker.http}/tokenize", {"prompt": "a", "messages": messages})
    assert status == 400
