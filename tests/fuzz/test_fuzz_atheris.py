"""Coverage-guided fuzzing of the event decoder with atheris, bounded for CI.

The harness (``atheris_events.py``) runs in a subprocess, seeded with valid batches in
both wire shapes, for a fixed number of inputs; libFuzzer exits non-zero on the first
input that raises anything but a documented rejection. Skipped where atheris has no
wheel (it ships manylinux x86_64 wheels for CPython 3.11).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from tests.support.paths import REPO_ROOT as REPO

pytestmark = pytest.mark.slow

pytest.importorskip("atheris")

HARNESS = Path(__file__).with_name("atheris_events.py")
NUM_RUNS = 20_000


def seed_corpus(directory: Path) -> None:
    stored = BlockStored(
        block_hashes=[2**64 - 1, 7],
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None, None],
        group_idx=0,
    )
    batch = KVEventBatch(
        ts=1.5, events=[stored, BlockRemoved(block_hashes=[7], medium="GPU"), AllBlocksCleared()]
    )
    legacy = [
        1.5,
        [
            ["BlockStored", [b"\x01" * 32], 5, [1, 2, 3, 4], 4, None, "GPU", None, [None], 0],
            ["BlockRemoved", [-3], "CPU", 0],
            ["AllBlocksCleared"],
        ],
    ]
    directory.mkdir()
    (directory / "map").write_bytes(encode_batch(batch))
    (directory / "legacy").write_bytes(msgspec.msgpack.encode(legacy))


def test_atheris_finds_no_crash_in_the_decoder(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    seed_corpus(corpus)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            f"-runs={NUM_RUNS}",
            "-seed=20261130",  # deterministic in CI; run the harness by hand to explore
            "-max_len=4096",
            "-rss_limit_mb=1024",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    tail = proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert f"Done {NUM_RUNS} runs" in proc.stderr, tail
    assert not list(tmp_path.glob("crash-*")), tail
