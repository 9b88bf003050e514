"""The official ``openai`` client against a real router (a ``kvroute router`` process) in
front of real ``kvroute worker`` processes: models, an unknown model, usage in streams, ``n``
choices, batch prompts, chat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator

import openai
import pytest

from tests.support.paths import REPO_ROOT as ROOT
from tests.support.router_cluster import WorkerProc, start_workers

pytestmark = pytest.mark.timeout(300)
START_TIMEOUT_S = 120.0
NO_EOS = {"ignore_eos": True}  # vLLM's extension, which kvroute workers take too


@pytest.fixture(scope="module")
def router_url(redis_url: str) -> Iterator[str]:
    """A router process in front of w0 (serving "tiny") and w1 ("tiny" and "tiny-2")."""
    names = {"w0": ["--served-model-name", "tiny"], "w1": ["--served-model-name", "tiny", "tiny-2"]}
    workers = start_workers(["w0", "w1"], num_blocks=256, args=names)
    specs = [a for w in workers for a in ("--worker", _spec(w))]
    router = subprocess.Popen(
        [sys.executable, "-m", "router", "router", "--redis", redis_url, "--port", "0",
         "--namespace", f"openai-{uuid.uuid4().hex[:8]}", "--log-level", "WARNING", *specs],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    try:
        assert router.stdout is not None
        line = router.stdout.readline()  # printed once the router listens (or it died)
        assert line, "the router exited before it was ready"
        url = json.loads(line)["router"]
        _wait_for_models(url, {"tiny", "tiny-2"})
        yield url
    finally:
        router.terminate()
        router.wait(timeout=30)
        for w in workers:
            w.kill()


def _spec(w: WorkerProc) -> str:
    return f"{w.worker_id}={w.http},events={w.events},replay={w.replay},block-size=16"


def _wait_for_models(url: str, expected: set[str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            if {m["id"] for m in json.loads(resp.read())["data"]} == expected:
                return
        assert time.monotonic() < deadline, "the router never learned the workers' models"
        time.sleep(0.1)  # polling a condition with a deadline


@pytest.fixture
def client(router_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=router_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_models_list_is_the_union_of_the_workers_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert sorted(m.id for m in models.data) == ["tiny", "tiny-2"]
    assert {m.object for m in models.data} == {"model"}


def test_a_request_goes_only_to_the_workers_serving_its_model(client: openai.OpenAI) -> None:
    for i in range(4):
        raw = client.completions.with_raw_response.create(
            model="tiny-2", prompt=f"only w1 serves this {i}", max_tokens=1
        )
        assert raw.headers["x-kvroute-worker"] == "w1"
        assert raw.parse().model == "tiny-2"


def test_an_unknown_model_is_openais_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="tinny", prompt="hi", max_tokens=1)
    assert (info.value.status_code, info.value.code) == (404, "model_not_found")
    assert "The model `tinny` does not exist" in info.value.message
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(
            model="tinny", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    assert chat.value.code == "model_not_found"


def test_streams_carry_usage_only_when_asked(client: openai.OpenAI) -> None:
    plain = list(
        client.completions.create(
            model="tiny", prompt="Stream me", max_tokens=3, stream=True, extra_body=NO_EOS
        )
    )
    assert all(chunk.usage is None for chunk in plain)
    assert "".join(c.choices[0].text for c in plain if c.choices)
    counted = list(
        client.completions.create(
            model="tiny", prompt="Stream me too", max_tokens=3, stream=True,
            stream_options={"include_usage": True}, extra_body=NO_EOS,
        )
    )  # fmt: skip
    assert counted[-1].choices == []
    assert counted[-1].usage is not None
    assert counted[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in counted[:-1])
    chat = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert {c.id for c in chat} == {chat[0].id}
    assert chat[0].id.startswith("chatcmpl-")
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices == []
    assert chat[-1].usage is not None
    assert chat[-1].usage.completion_tokens == 2


def test_n_gives_that_many_choices(client: openai.OpenAI) -> None:
    two = client.completions.create(
        model="tiny", prompt="Once upon a time", n=2, max_tokens=4, temperature=1.0, seed=3,
        extra_body=NO_EOS,
    )  # fmt: skip
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage is not None
    assert two.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=2,
        temperature=1.0, seed=3,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.id.startswith("chatcmpl-")
    assert all(c.message.role == "assistant" for c in chat.choices)


def test_a_batch_prompt_gets_its_choices_in_prompt_order(client: openai.OpenAI) -> None:
    prompts = ["The first prompt of the batch", "A second, different prompt", "Third"]
    batch = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=3, temperature=0, extra_body=NO_EOS
    )
    assert [c.index for c in batch.choices] == [0, 1, 2]
    # Greedy, the same weights on every worker: each choice is its prompt's own answer.
    alone = [
        client.completions.create(
            model="tiny", prompt=p, max_tokens=3, temperature=0, extra_body=NO_EOS
        )
        .choices[0]
        .text
        for p in prompts
    ]
    assert [c.text for c in batch.choices] == alone
    assert batch.usage is not None
    assert batch.usage.completion_tokens == 9
