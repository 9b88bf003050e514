"""Observability of a router in front of a real kvroute worker: accuracy, latency, ids, dashboard.

The worker is a real ``kvroute worker`` subprocess (byte-level tokenizer, tiny model, CPU);
the routers run in process, so the tests read their logs; ``kvroute index check`` runs as a
subprocess, as users run it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.front.accuracy import AccuracyConfig
from router.front.tokenization import TokenizerSources
from tests.support.paths import REPO_ROOT as ROOT
from tests.support.router_cluster import WorkerProc, complete, router, start_workers

DASHBOARD = ROOT / "examples" / "grafana" / "kvroute-dashboard.json"
pytestmark = pytest.mark.timeout(240)
# A small window, so a handful of requests fills it; one warning per worker per run.
ACCURACY = AccuracyConfig(window_requests=4, min_tokens=64, warn_interval_s=600.0)


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProc]:
    (started,) = start_workers(["o0"])
    yield started
    started.kill()


def word_tokenizer(path: Path, text: str) -> Path:
    """A Hugging Face ``tokenizer.json`` that splits on words and punctuation (far fewer
    tokens than the worker's bytes, and other ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(re.findall(r"\w+|[^\w\s]", text)))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """``/metrics`` as ``{(sample name, sorted labels as k=v,...): value}``."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[(s.name, labels)] = s.value
    return out


def index_check(redis_url: str, namespace: str, router_url: str, *flags: str) -> tuple[int, str]:
    """``kvroute index check --router``: exit code and output."""
    argv = [sys.executable, "-m", "router", "index", "check", "--redis", redis_url,
            "--namespace", namespace, "--router", router_url, *flags]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, proc.stdout


@dataclass
class Run:
    """What one router run showed: its metrics, the hits the worker reported, and what
    ``kvroute index check --router`` said (exit code, the worker's routing accuracy)."""

    metrics: dict[tuple[str, str], float]
    reported: int
    check_code: int
    check_accuracy: dict[str, Any]
    check_text: str


def accuracy_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "router.front.accuracy" and r.levelno == logging.WARNING
    ]


def test_routing_accuracy_catches_a_router_started_with_the_wrong_tokenizer(
    redis_url: str,
    namespace: str,
    worker: WorkerProc,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="router.front.accuracy")
    wrong_prefix = "You are a careful assistant. " * 9  # 261 bytes, 54 words
    right_prefix = "You are a meticulous reviewer. " * 9  # 279 bytes
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json", wrong_prefix + " question 0123456789")
    w = worker.worker_id

    async def run(prefix: str, ns: str, **kw: Any) -> Run:
        """Eight requests sharing ``prefix`` through a router of this configuration."""
        async with (
            router(redis_url, ns, [worker.record()], accuracy=ACCURACY, **kw) as svc,
            aiohttp.ClientSession() as s,
        ):
            reported = 0
            for i in range(8):
                served, usage = await complete(s, svc.url, f"{prefix} question {i}")
                assert served == w
                reported += usage["cached_tokens"]
            metrics = await scrape(s, svc.url)
            code, out = await asyncio.to_thread(index_check, redis_url, ns, svc.url, "--json")
            row = next(r for r in json.loads(out) if r["worker_id"] == w)
            _, text = await asyncio.to_thread(index_check, redis_url, ns, svc.url)
            return Run(metrics, reported, code, row["routing_accuracy"], text)

    wrong = asyncio.run(
        run(wrong_prefix, namespace, tokenizers=TokenizerSources.from_flags([str(tokenizer)]))
    )
    # Each repeat hits 16 blocks of the worker's bytes (256 tokens); the router expected the
    # 3 blocks of its own words it credited the worker with (48 tokens).
    assert wrong.reported == 7 * 256
    assert wrong.metrics[("kvroute_router_reported_cached_tokens_total", f"worker={w}")] == 7 * 256
    assert wrong.metrics[("kvroute_router_expected_cached_tokens_total", f"worker={w}")] == 7 * 48
    ratio = wrong.metrics[("kvroute_router_routing_accuracy_ratio", f"worker={w}")]
    assert ratio == pytest.approx(48 / 256)
    (warning,) = accuracy_warnings(caplog)  # one warning however many bad requests
    assert warning.startswith(f"worker {w}: routing accuracy 0.19 over its last 4 requests")
    assert "the router's --tokenizer or --chat-template is not the worker's" in warning
    assert "the router does not see what this worker caches" in warning
    assert wrong.check_code == 1
    assert wrong.check_accuracy == {
        "expected_cached_tokens": 7 * 48,
        "reported_cached_tokens": 7 * 256,
        "ratio": pytest.approx(48 / 256),
        "low": True,
    }
    line = next(x for x in wrong.check_text.splitlines() if x.startswith(f"{w} ") and "low" in x)
    assert line.split()[:4] == [w, "336", "1,792", "0.19"]
    assert "workers below the accuracy threshold: 1" in wrong.check_text

    caplog.clear()
    right = asyncio.run(run(right_prefix, f"{namespace}-right"))
    assert right.reported == 7 * 288  # 18 whole blocks of the 289 bytes every repeat shares
    assert right.metrics[("kvroute_router_expected_cached_tokens_total", f"worker={w}")] == 7 * 288
    assert right.metrics[("kvroute_router_routing_accuracy_ratio", f"worker={w}")] == 1.0
    assert accuracy_warnings(caplog) == []
    assert right.check_accuracy["ratio"] == 1.0 and not right.check_accuracy["low"]


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], request_id: str
) -> tuple[str, list[dict[str, Any]]]:
    """A streamed completion: the answer's ``X-Request-Id`` and its chunks."""
    headers = {"X-Request-Id": request_id}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        chunks = [
            json.loads(line[6:])
            for line in (await resp.text()).splitlines()
            if line.startswith("data: {")
        ]
        return resp.headers["X-Request-Id"], chunks


def test_latency_histograms_token_counters_and_request_ids(
    redis_url: str, namespace: str, worker: WorkerProc
) -> None:
    w = worker.worker_id

    async def scenario() -> None:
        async with (
            router(redis_url, namespace, [worker.record()]) as svc,
            aiohttp.ClientSession() as s,
        ):
            body = {"prompt": "Histograms, please. " * 4, "max_tokens": 3, "stream": True,
                    "stream_options": {"include_usage": True},
                    "model": "kvroute-tiny", "ignore_eos": True}  # fmt: skip
            answered_id, chunks = await stream(s, svc.url, body, "obs-1")
            # The worker got the id: it names the completion; the router answers with it.
            assert answered_id == "obs-1"
            assert all(c["id"].endswith("-obs-1") for c in chunks)
            usage = chunks[-1]["usage"]
            await complete(s, svc.url, "Another prompt, another model.")  # no model: unknown
            async with s.post(
                f"{svc.url}/v1/completions",
                json={"prompt": "x" * 40, "max_tokens": 1, "model": "not-served-here"},
            ) as resp:  # a model no worker serves: refused before routing, still identified
                assert resp.status == 404
                assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["X-Request-Id"])
                assert (await resp.json())["error"]["code"] == "model_not_found"
            m = await scrape(s, svc.url)
        ttft = f"model=kvroute-tiny,worker={w}"
        assert m[("kvroute_router_time_to_first_token_seconds_count", ttft)] == 1
        assert 0 < m[("kvroute_router_time_to_first_token_seconds_sum", ttft)] < 60
        for model in ("kvroute-tiny", "unknown"):
            labels = f"model={model},worker={w}"
            assert m[("kvroute_router_e2e_request_latency_seconds_count", labels)] == 1
            assert m[("kvroute_router_queue_seconds_count", f"model={model}")] == 1
        # Only the stream had a first token to time.
        assert ("kvroute_router_time_to_first_token_seconds_count", f"model=unknown,worker={w}") \
            not in m  # fmt: skip
        prompt_tokens = 80 + 30  # byte-level: what the worker counted too
        assert m[("kvroute_router_prompt_tokens_total", f"worker={w}")] == prompt_tokens
        assert usage["prompt_tokens"] == 80

    asyncio.run(scenario())


def dashboard_metrics() -> set[str]:
    """Every metric name the dashboard's queries (and its variables) read."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return {name for e in exprs for name in re.findall(r"\bkvroute_[a-z0-9_]+", e)}


def exposed(text: str) -> set[str]:
    """Names a ``/metrics`` text offers: samples, and families (declared, even without a
    sample yet) with each suffix a query may add."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        names.update(family.name + x for x in suffixes.get(family.type, ("",)))
    return names


def test_every_metric_the_dashboard_queries_exists(
    redis_url: str, namespace: str, worker: WorkerProc
) -> None:
    wanted = dashboard_metrics()
    # The five subjects of the dashboard are all there.
    for name in ("kvroute_router_reported_cached_tokens_total",
                 "kvroute_router_routing_accuracy_ratio",
                 "kvroute_router_time_to_first_token_seconds_bucket",
                 "kvroute_router_decisions_total", "kvroute_stream_gaps_total"):  # fmt: skip
        assert name in wanted
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["templating"]["list"][0]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"

    async def scenario() -> set[str]:
        async with (
            router(redis_url, namespace, [worker.record()], accuracy=ACCURACY) as svc,
            aiohttp.ClientSession() as s,
        ):
            prefix = "Dashboard check, shared prefix. " * 4
            for i in range(4):
                await complete(s, svc.url, f"{prefix}{i}")
            await stream(s, svc.url, {"prompt": prefix, "max_tokens": 2, "stream": True}, "d1")
            texts = []
            for url in (svc.url, worker.http):
                async with s.get(f"{url}/metrics") as resp:
                    texts.append(await resp.text())
            return exposed(texts[0]) | exposed(texts[1])

    available = asyncio.run(scenario())
    assert sorted(wanted - available) == []
