"""The completions wire format: body parsing, streaming text deltas, usage."""

from __future__ import annotations

import pytest

from events.tokenizer import ByteTokenizer
from pool.worker.completions import (
    CompletionRequest,
    CompletionRequestError,
    IncrementalText,
    completion_chunk,
    parse_completion_request,
    usage,
)
from pool.worker.engine import SamplingParams
from pool.worker.outputs import RequestOutput


def test_defaults_and_text_prompts() -> None:
    parsed = parse_completion_request(b'{"prompt": "hi", "max_tokens": null}', ByteTokenizer())
    assert parsed == CompletionRequest([104, 105], SamplingParams(), stream=False)
    full = parse_completion_request(
        b'{"prompt": [1, 2], "max_tokens": 3, "temperature": 1, "stream": true,'
        b' "ignore_eos": true, "seed": 0, "unknown": "ignored"}',
        ByteTokenizer(),
    )
    assert full == CompletionRequest([1, 2], SamplingParams(3, 1.0, True, 0), stream=True)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"prompt": "a\\ud800"}', "'prompt' is not valid Unicode text"),
        (b'{"prompt": [true]}', "'prompt' must be a string or a list of token ids"),
        (b'{"prompt": "x", "seed": 1.5}', "'seed' must be an integer, got 1.5"),
        (b'{"prompt": "x", "temperature": false}', "'temperature' must be a number"),
    ],
)
def test_malformed_fields(raw: bytes, message: str) -> None:
    with pytest.raises(CompletionRequestError, match=message):
        parse_completion_request(raw, ByteTokenizer())


def test_streamed_text_holds_back_split_utf8() -> None:
    text = IncrementalText(ByteTokenizer())
    euro = list("€".encode())  # three bytes
    assert text.push([104], False) == "h"
    assert text.push(euro[:1], False) == ""
    assert text.push(euro[1:2], False) == ""
    assert text.push(euro[2:], False) == "€"
    assert text.push([0xE2], True) == "\ufffd"  # finished mid-character: sent as is


def test_chunk_and_usage_shapes() -> None:
    out = RequestOutput("cmpl-1", [7], "length", 10, 8, 3)
    chunk = completion_chunk("cmpl-1", "m", "x", [7], "length")
    assert chunk["choices"] == [
        {"index": 0, "text": "x", "token_ids": [7], "finish_reason": "length"}
    ]
    assert (chunk["id"], chunk["object"], chunk["model"]) == ("cmpl-1", "text_completion", "m")
    assert usage(out) == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "cached_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
