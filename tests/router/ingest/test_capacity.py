"""How many workers a router process can ingest, from its file descriptors and sockets."""

from __future__ import annotations

import resource

import pytest

from router.ingest.capacity import (
    FDS_PER_WORKER,
    RESERVED_FDS,
    CapacityError,
    FleetCapacity,
    fd_limit,
    raise_fd_limit,
)


def test_capacity_is_the_tighter_of_descriptors_and_sockets() -> None:
    assert FleetCapacity(RESERVED_FDS + 1000 * FDS_PER_WORKER, 16_384).max_workers == 1000
    assert FleetCapacity(1_000_000, 16_384).max_workers == 4096  # 4 sockets per worker
    assert FleetCapacity(1024, 16_384).max_workers == (1024 - RESERVED_FDS) // FDS_PER_WORKER
    assert FleetCapacity(100, 16_384).max_workers == 0


def test_a_check_beyond_capacity_names_the_limits_and_the_fix() -> None:
    capacity = FleetCapacity(RESERVED_FDS + 10 * FDS_PER_WORKER, 16_384)
    capacity.check(10)
    with pytest.raises(CapacityError) as caught:
        capacity.check(11)
    message = str(caught.value)
    assert "at most 10 workers, 11 asked for" in message
    assert f"file descriptor limit {RESERVED_FDS + 10 * FDS_PER_WORKER}" in message
    assert "ulimit -n" in message


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 1024) if hard == resource.RLIM_INFINITY else min(soft, hard, 1024)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        raised = raise_fd_limit()
        assert raised == fd_limit()
        assert raised == (lowered if hard == resource.RLIM_INFINITY else hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, fd_limit()), hard))
