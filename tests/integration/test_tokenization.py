"""Tokenization parity: a router keys requests with exactly the ids a worker caches, from a
local Hugging Face tokenizer directory or from the worker's own ``POST /tokenize``.

The worker is a real ``kvroute worker`` process serving a Hugging Face tokenizer built here
with the ``tokenizers`` library (a word-level vocabulary, a BOS post-processor, and a chat
template in ``tokenizer_config.json``); the routers run in process.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.front.tokenization import TokenizerSources
from tests.support.polling import eventually
from tests.support.router_cluster import (
    BLOCK,
    BOUND_S,
    WorkerProc,
    dry_route,
    router,
    start_workers,
)

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

WORDS = [f"w{i}" for i in range(200)]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m.role }} {{ m.content }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant {% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory: tokenizer.json (word level, BOS added to prompts) and a
    tokenizer_config.json with the special tokens and a chat template."""
    path = tmp_path_factory.mktemp("model")
    specials = ["[UNK]", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate([*specials, "user", "assistant", *WORDS])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def worker(model_dir: Path) -> Iterator[WorkerProc]:
    (started,) = start_workers(["hf"], args={"hf": ["--tokenizer", str(model_dir)]})
    yield started
    started.kill()


def _prompt(first: int) -> str:
    return " ".join(WORDS[first : first + 64])  # 64 words, 65 ids with the BOS


async def _post(s: aiohttp.ClientSession, url: str, path: str, body: Any) -> Any:
    async with s.post(f"{url}{path}", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return answer


def test_a_local_tokenizer_directory_keys_as_the_worker_caches(
    redis_url: str, namespace: str, worker: WorkerProc, model_dir: Path
) -> None:
    local = TokenizerSources.from_flags([str(model_dir)])

    async def scenario() -> None:
        async with (
            router(redis_url, namespace, [worker.record()], tokenizers=local) as svc,
            aiohttp.ClientSession() as s,
        ):
            prompt = _prompt(0)
            body = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True}
            first = await _post(s, svc.url, "/v1/completions", body)
            assert first["usage"]["prompt_tokens"] == 65  # the BOS: as vLLM encodes prompts
            await eventually(
                lambda: _matched(s, svc.url, prompt, 64),
                "the prompt's 4 blocks indexed",
                timeout_s=BOUND_S,
            )
            again = await _post(s, svc.url, "/v1/completions", body)
            assert again["usage"]["cached_tokens"] == 64
            # Chat: the directory's template, rendered by the router as by the worker.
            chat = {"messages": [{"role": "user", "content": _prompt(100)}], "max_tokens": 1}
            rendered = await _post(s, worker.http, "/tokenize", {"messages": chat["messages"]})
            ids = await svc.tokenizer.chat_tokens(None, chat, svc.workers)
            assert ids == rendered["tokens"]
            assert ids is not None and ids[:3] == [1, 3, 105]  # <s> user w100: no second BOS
            await _post(s, svc.url, "/v1/chat/completions", chat)
            await eventually(
                lambda: _chat_matched(s, svc, chat), "the chat prompt matched", timeout_s=BOUND_S
            )

    asyncio.run(scenario())


def test_the_engines_tokenize_gives_the_same_keys_as_the_local_tokenizer(
    redis_url: str, namespace: str, worker: WorkerProc, model_dir: Path
) -> None:
    local = TokenizerSources.from_flags([str(model_dir)])
    engine = TokenizerSources.from_flags(via_engine=[""])

    async def scenario() -> None:
        async with (
            router(redis_url, namespace, [worker.record()], tokenizers=local) as by_file,
            router(redis_url, namespace, [worker.record()], tokenizers=engine) as by_engine,
            aiohttp.ClientSession() as s,
        ):
            for r in (by_file, by_engine):
                await eventually(
                    lambda r=r: _learned(r), "the worker's model learned", timeout_s=BOUND_S
                )  # type: ignore[misc]
            model, workers = by_engine.select_model(None)
            assert model == "kvroute-tiny"
            prompt = _prompt(50)
            for text_or_chat in (prompt, {"messages": [{"role": "user", "content": prompt}]}):
                if isinstance(text_or_chat, str):
                    ids = [
                        await r.tokenizer.prompt_tokens(model, text_or_chat, None, workers)
                        for r in (by_file, by_engine)
                    ]
                else:
                    ids = [
                        await r.tokenizer.chat_tokens(model, text_or_chat, workers)
                        for r in (by_file, by_engine)
                    ]
                assert ids[0] is not None
                assert ids[0] == ids[1]
            await _post(s, by_engine.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
            # One index, the same keys from either router.
            await eventually(
                lambda: _matched(s, by_engine.url, prompt, 64),
                "the prompt indexed",
                timeout_s=BOUND_S,
            )
            assert await _matched(s, by_file.url, prompt, 64)
            async with s.get(f"{by_engine.url}/metrics") as resp:
                metrics = await resp.text()
            # The route requests repeated the prompt: answered from the cache, one fetch.
            assert 'kvroute_router_engine_tokenize_total{outcome="fetched"} 2.0' in metrics

    asyncio.run(scenario())


async def _learned(svc: Any) -> bool:
    return bool(svc.models.served(svc.workers) == ["kvroute-tiny"])


async def _matched(s: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> bool:
    route = await dry_route(s, url, prompt)
    return bool(route["matched_tokens"] == tokens)


async def _chat_matched(s: aiohttp.ClientSession, svc: Any, chat: dict[str, Any]) -> bool:
    """Whether a chat request now finds its whole prompt's blocks in the index."""
    ids = await svc.tokenizer.chat_tokens(None, chat, svc.workers)
    routed = await svc.decide(ids, 1, record=False)
    return bool(routed.decision.chosen.matched_tokens == len(ids) // BLOCK * BLOCK)
