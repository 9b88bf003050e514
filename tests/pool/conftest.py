"""Fixtures of the pool tests: torch runs on one thread.

The suite shares two cores with concurrent test runs; torch's intra-op thread pool then
spins against the other processes and a tiny forward pass gets ~30x slower.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    try:
        import torch
    except ImportError:  # the pure-Python pool tests run without torch
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
