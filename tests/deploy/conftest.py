"""Fixtures of the deployment tests: the routes the real router and worker applications serve."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from router.front.app import make_app
from router.front.config import RouterConfig
from router.front.service import RouterService
from tests.support.deploy import routes


@pytest.fixture(scope="session")
def router_routes(redis_url: str) -> set[tuple[str, str]]:
    """``(method, path)`` of every route of a router's application (a real, opened service)."""

    async def read() -> set[tuple[str, str]]:
        config = RouterConfig(redis_url=redis_url, namespace=f"test-{uuid.uuid4().hex}", port=0)
        async with await RouterService.open(config) as service:
            return routes(make_app(service))

    return asyncio.run(read())


@pytest.fixture(scope="session")
def worker_routes() -> set[tuple[str, str]]:
    """``(method, path)`` of every route of a worker's application (a real engine, not run)."""
    pytest.importorskip("torch")
    from events.tokenizer import load_tokenizer
    from pool.worker.config import WorkerConfig
    from pool.worker.http import WorkerHTTP, WorkerInfo
    from pool.worker.model import DecoderModel
    from tests.support.engine import make_engine

    config = WorkerConfig(num_blocks=8)
    tokenizer = load_tokenizer(None)
    engine = make_engine(DecoderModel(config.model_config(tokenizer), "cpu"), config.num_blocks)
    return routes(WorkerHTTP(engine, tokenizer, WorkerInfo("w")).app)


@pytest.fixture
def app_routes(
    router_routes: set[tuple[str, str]], worker_routes: set[tuple[str, str]]
) -> dict[str, set[tuple[str, str]]]:
    """Role (``router``, ``worker``) -> the routes its application serves."""
    return {"router": router_routes, "worker": worker_routes}
