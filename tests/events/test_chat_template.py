"""Chat templates and tokenizer directories, shared by workers and routers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from events.chat_template import (
    BuiltinChatTemplate,
    ChatTemplateError,
    HFChatTemplate,
    find_chat_template,
    load_chat_template,
)
from events.tokenizer import TokenizerError, load_tokenizer

pytest.importorskip("jinja2")
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
]


def test_the_builtin_template_joins_text_parts_by_newlines() -> None:
    template = BuiltinChatTemplate()
    assert template.render(MESSAGES) == "<|system|>\nbe brief\n<|user|>\na\nb\n<|assistant|>\n"
    assert template.render(MESSAGES[:1], add_generation_prompt=False) == "<|system|>\nbe brief\n"
    assert template.render([{"role": "assistant", "content": None}]).startswith("<|assistant|>\n\n")
    with pytest.raises(ChatTemplateError, match="has no string 'role'"):
        template.render([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="only text parts"):
        template.render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_a_model_directory_gives_its_template_and_special_tokens(tmp_path: Path) -> None:
    config = {
        "bos_token": {"content": "<s>"},
        "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert find_chat_template(tmp_path) == tmp_path / "tokenizer_config.json"
    template = load_chat_template(None, tmp_path)
    assert template.render(MESSAGES) == "<s>system:be brief</s>user:a\nb</s>assistant:"
    # chat_template.jinja, where recent releases keep it, wins; tokens still from the config.
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages|length }}")
    assert load_chat_template(None, tmp_path / "tokenizer.json").render(MESSAGES) == "<s>2"
    # An explicit template wins over the directory's.
    override = tmp_path / "other.jinja"
    override.write_text("{{ messages[0].role }}")
    assert load_chat_template(override, tmp_path).render(MESSAGES) == "system"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert isinstance(load_chat_template(None, empty), BuiltinChatTemplate)


def test_template_failures_are_the_requests(tmp_path: Path) -> None:
    refusing = HFChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="refused the messages: roles must alternate"):
        refusing.render(MESSAGES)
    iterating = HFChatTemplate("{% for t in tools %}{{ t }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        iterating.render(MESSAGES, extra={"tools": 5})
    with pytest.raises(ChatTemplateError, match="has no chat_template string"):
        (tmp_path / "c.json").write_text("{}")
        HFChatTemplate.from_file(tmp_path / "c.json")
    with pytest.raises(ChatTemplateError):
        HFChatTemplate("{% for %}")


def test_a_tokenizer_directory_loads_with_its_eos_and_adds_special_tokens(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "<s>": 1, "<eot>": 2, "hello": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<eot>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eot>"}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_token_id == 2  # named by the config, not guessed
    assert loaded.encode("hello") == [3]
    assert loaded.encode("hello", add_special_tokens=True) == [1, 3]
    with pytest.raises(TokenizerError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "empty-dir-or-missing")
