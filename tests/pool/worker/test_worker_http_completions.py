"""The worker's OpenAI wire format: body parsing, choice text, stop strings, answers."""

from __future__ import annotations

import pytest

from events.chat_template import BuiltinChatTemplate
from events.tokenizer import ByteTokenizer
from pool.worker.body_fields import CompletionRequestError, ModelNotFoundError
from pool.worker.choice_text import ChoiceText
from pool.worker.completions import (
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from pool.worker.engine import SamplingParams
from pool.worker.outputs import TokenLogprobs
from pool.worker.responses import AnswerShape, ChoiceResult, usage

TOK = ByteTokenizer()
SERVED = ("tiny", "tiny-alias")


def test_defaults_and_text_prompts() -> None:
    parsed = parse_completion_request(b'{"prompt": "hi", "max_tokens": null}', TOK, SERVED)
    assert parsed == CompletionRequest("tiny", [[104, 105]], SamplingParams())
    full = parse_completion_request(
        b'{"prompt": [1, 2], "max_tokens": 3, "temperature": 1, "stream": true, "model":'
        b' "tiny-alias", "ignore_eos": true, "seed": 0, "stream_options": {"include_usage":'
        b' true}, "stop": "x", "n": 2, "logprobs": 1, "cache_salt": "s"}',
        TOK,
        SERVED,
    )
    assert full == CompletionRequest(
        "tiny-alias",
        [[1, 2]],
        SamplingParams(3, 1.0, True, 0, logprobs=1),
        n=2,
        stop=("x",),
        stream=True,
        include_usage=True,
        cache_salt="s",
    )


def test_a_batch_prompt_is_one_prompt_per_entry_and_n_choices_each() -> None:
    parsed = parse_completion_request(
        b'{"prompt": ["ab", "c"], "n": 2, "seed": 7, "temperature": 1}', TOK, SERVED
    )
    assert parsed.prompts == [[97, 98], [99]]
    assert parsed.num_choices == 4
    assert [parsed.prompt_of(c) for c in range(4)] == [[97, 98], [97, 98], [99], [99]]
    # Choice i of each prompt samples with seed + i (vLLM's rule for n).
    assert [parsed.choice_params(c).seed for c in range(4)] == [7, 8, 7, 8]
    ids = parse_completion_request(b'{"prompt": [[1, 2], [3]]}', TOK, SERVED)
    assert ids.prompts == [[1, 2], [3]]
    unseeded = parse_completion_request(b'{"prompt": "a", "n": 3}', TOK, SERVED)
    assert {unseeded.choice_params(c).seed for c in range(3)} == {None}


def test_a_request_without_model_gets_the_first_served_name() -> None:
    assert parse_completion_request(b'{"prompt": "a"}', TOK, SERVED).model == "tiny"
    with pytest.raises(ModelNotFoundError, match="The model `tinny` does not exist") as info:
        parse_completion_request(b'{"prompt": "a", "model": "tinny"}', TOK, SERVED)
    assert "tiny, tiny-alias" in str(info.value)


@pytest.mark.parametrize(
    ("raw", "param", "message"),
    [
        (b'{"prompt": "a\\ud800"}', "prompt", "'prompt' is not valid Unicode text"),
        (b'{"prompt": [true]}', "prompt", "'prompt' must be a string or a list of token ids"),
        (b'{"prompt": [[1], "a"]}', "prompt", "'prompt' must be a string or a list of token"),
        (b'{"prompt": "x", "seed": 1.5}', "seed", "'seed' must be an integer, got 1.5"),
        (b'{"prompt": "x", "temperature": false}', "temperature", "'temperature' must be a"),
        (b'{"prompt": "x", "model": 3}', "model", "'model' must be a string"),
        (b'{"prompt": "x", "n": 0}', "n", "'n' must be in [1, 128], got 0"),
        (b'{"prompt": ["a", "b"], "n": 65}', "prompt", "2 prompts x n=65 is 130 choices"),
        (b'{"prompt": "x", "stop": ""}', "stop", "'stop' must be a non-empty string"),
        (b'{"prompt": "x", "stop": [1]}', "stop", "'stop' must be a non-empty string"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options",
         "'stream_options' is only allowed with 'stream': true"),
        (b'{"prompt": "x", "stream": true, "stream_options": {"continuous_usage_stats": true}}',
         "stream_options", "continuous_usage_stats is not supported"),
        (b'{"prompt": "x", "best_of": 3}', "best_of", "'best_of' (3) other than 'n'"),
        (b'{"prompt": "x", "frequency_penalty": 0.5}', "frequency_penalty",
         "parameter 'frequency_penalty' = 0.5 is not supported by this worker; leave it out "
         "or send 0"),
        (b'{"prompt": "x", "echo": true}', "echo", "parameter 'echo' = true is not supported"),
        (b'{"prompt": "x", "logit_bias": {"1": 5}}', "logit_bias", "'logit_bias'"),
        (b'{"prompt": "x", "prompt_logprobs": 1}', "prompt_logprobs", "leave it out"),
        (b'{"prompt": "x", "guided_json": {}}', "guided_json",
         "unknown parameter 'guided_json': this worker does not support it"),
    ],
)  # fmt: skip
def test_malformed_or_unsupported_fields_name_the_parameter(
    raw: bytes, param: str | None, message: str
) -> None:
    with pytest.raises(CompletionRequestError) as info:
        parse_completion_request(raw, TOK, SERVED)
    assert message in str(info.value)
    assert info.value.param == param


def test_harmless_parameters_at_neutral_values_are_accepted() -> None:
    raw = (
        b'{"prompt": "x", "user": "u-1", "frequency_penalty": 0, "presence_penalty": 0.0,'
        b' "logit_bias": {}, "echo": false, "best_of": 1, "metadata": {"a": "b"},'
        b' "suffix": null, "stream": false, "stream_options": null}'
    )
    assert parse_completion_request(raw, TOK, SERVED).prompts == [[120]]


def test_chat_requests_render_their_messages_and_take_chat_logprobs() -> None:
    raw = (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]}], "logprobs": true, "top_logprobs": 2,'
        b' "max_completion_tokens": 5}'
    )
    parsed = parse_chat_request(raw, TOK, BuiltinChatTemplate(), SERVED, max_model_len=100)
    assert parsed.prompts == [list(b"<|user|>\na\nb\n<|assistant|>\n")]
    assert (parsed.params.max_tokens, parsed.params.logprobs) == (5, 2)
    # Without a limit, the choices may use the rest of the context, as vLLM allows.
    bare = parse_chat_request(
        b'{"messages": [{"role": "user", "content": "hi"}]}', TOK, BuiltinChatTemplate(),
        SERVED, max_model_len=100,
    )  # fmt: skip
    assert bare.params.max_tokens == 100 - len(bare.prompts[0])
    assert bare.params.logprobs is None
    with pytest.raises(CompletionRequestError, match="'top_logprobs' needs 'logprobs': true"):
        parse_chat_request(
            b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 1}',
            TOK, BuiltinChatTemplate(), SERVED,
        )  # fmt: skip
    with pytest.raises(CompletionRequestError, match="parameter 'tools'"):
        parse_chat_request(
            b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "f"}]}',
            TOK, BuiltinChatTemplate(), SERVED,
        )  # fmt: skip


def test_choice_text_holds_back_split_utf8() -> None:
    text = ChoiceText(TOK)
    euro = list("€".encode())  # three bytes
    assert text.push([104], False) == "h"
    assert text.push(euro[:1], False) == ""
    assert text.push(euro[1:2], False) == ""
    assert text.push(euro[2:], False) == "€"
    assert text.push([0xE2], True) == "\ufffd"  # finished mid-character: sent as is
    assert text.text == "h€\ufffd"


def test_a_stop_string_ends_the_text_before_it_even_across_tokens() -> None:
    text = ChoiceText(TOK, ["END", "zz"])
    sent = [text.push(list(piece.encode()), False) for piece in ("ab", "cE", "N", "Dxyz")]
    # The last len("END") - 1 characters may begin a stop string: held back.
    assert sent == ["", "ab", "c", ""]
    assert (text.text, text.stop_reason, text.stopped) == ("abc", "END", True)
    assert text.push([120], False) == ""  # nothing after the stop


def test_held_back_text_goes_out_when_it_is_no_stop_string() -> None:
    text = ChoiceText(TOK, ["END"])
    assert text.push(list(b"abE"), False) == "a"
    assert text.push(list(b"Nx"), False) == "bE"
    assert text.push(list(b"y"), True) == "Nxy"
    assert (text.text, text.stop_reason) == ("abENxy", None)


def test_completion_answer_and_stream_shapes() -> None:
    shape = AnswerShape("completion", "m", TOK, include_usage=True)
    assert shape.id.startswith("cmpl-")
    chunk = shape.delta_chunk(1, "x", [120], None, "length")
    assert (chunk["id"], chunk["object"], chunk["model"]) == (shape.id, "text_completion", "m")
    assert chunk["choices"] == [
        {"index": 1, "text": "x", "token_ids": [120], "logprobs": None,
         "finish_reason": "length", "stop_reason": None}
    ]  # fmt: skip
    assert chunk["usage"] is None  # include_usage: null on every chunk but the last
    last = shape.usage_chunk(usage(10, 3, 8))
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "cached_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    assert "usage" not in AnswerShape("completion", "m", TOK).delta_chunk(0, "", [], None, None)


def test_completion_logprobs_in_the_legacy_shape() -> None:
    shape = AnswerShape("completion", "m", TOK)
    entries = [
        TokenLogprobs(104, -0.5, ((104, -0.5), (105, -1.5))),
        TokenLogprobs(105, -float("inf"), ((104, -0.1),)),
    ]
    answer = shape.whole([ChoiceResult(0, "hi", [104, 105], entries, "length")], usage(1, 2, 0))
    assert answer["choices"][0]["logprobs"] == {
        "tokens": ["h", "i"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"h": -0.5, "i": -1.5}, {"i": -9999.0, "h": -0.1}],
        "text_offset": [0, 1],
    }
    # Streamed, the offsets continue from the text already sent.
    first = shape.delta_chunk(0, "h", [104], entries[:1], None)
    second = shape.delta_chunk(0, "i", [105], entries[1:], "length")
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert second["choices"][0]["logprobs"]["text_offset"] == [1]


def test_chat_answers_and_chunks() -> None:
    shape = AnswerShape("chat", "m", TOK)
    assert shape.id.startswith("chatcmpl-")
    entries = [TokenLogprobs(104, -0.25, ((104, -0.25), (105, -2.0)))]
    whole = shape.whole([ChoiceResult(0, "h", [104], entries, "stop", "END")], usage(1, 1, 0))
    assert whole["object"] == "chat.completion"
    assert whole["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "h"},
            "logprobs": {
                "content": [
                    {
                        "token": "h", "logprob": -0.25, "bytes": [104],
                        "top_logprobs": [
                            {"token": "h", "logprob": -0.25, "bytes": [104]},
                            {"token": "i", "logprob": -2.0, "bytes": [105]},
                        ],
                    }
                ]
            },
            "finish_reason": "stop",
            "stop_reason": "END",
        }
    ]  # fmt: skip
    assert shape.role_chunk(1)["choices"] == [
        {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
    ]  # fmt: skip
    chunk = shape.delta_chunk(1, "x", [120], None, None)
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"] == [
        {"index": 1, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}
    ]
    end = shape.delta_chunk(1, "", [], None, "length")
    assert end["choices"][0]["delta"] == {}
