"""Tokenizers: byte-level round trips and the Hugging Face tokenizer.json path."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.tokenizer import (
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)


def test_byte_tokenizer_ids_are_utf8_bytes() -> None:
    tok = load_tokenizer()
    assert isinstance(tok, ByteTokenizer)
    assert isinstance(tok, Tokenizer)
    assert tok.encode("hé!") == [104, 195, 169, 33]
    assert tok.vocab_size == BYTE_VOCAB_SIZE == 258
    assert tok.eos_token_id == BYTE_EOS_ID == 256
    assert tok.decode([104, 195, 169, 33, BYTE_EOS_ID]) == "hé!"
    assert tok.decode([104, 195]) == "h\ufffd"


@settings(max_examples=50)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_hf_tokenizer_json(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_special_tokens(["</s>"])
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world hello") == [2, 3, 2]
    assert tok.eos_token_id == 1
    assert tok.vocab_size == 4
    assert tok.decode([2, 1, 3]) == "hello world"


def test_bad_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load tokenizer file"):
        load_tokenizer(path)
