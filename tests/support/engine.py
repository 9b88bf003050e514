"""An engine under test in process: a sink for its event batches, its outputs, a driver.

The engine runs on the caller's thread (``run_until_idle``) with a small pool of 4-token
blocks, events on, EOS token 256; prompts are deterministic per ``(length, salt)``.
"""

from __future__ import annotations

from events.schema import KVEventBatch
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.worker.engine import Engine, EngineConfig, SamplingParams
from pool.worker.model import DecoderModel
from pool.worker.outputs import RequestOutput

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


class ListSink:
    """Collects the engine's event batches (the publisher's role, without a socket)."""

    def __init__(self, accept: bool = True) -> None:
        self.batches: list[KVEventBatch] = []
        self.accept = accept

    def publish(self, batch: KVEventBatch) -> bool:
        self.batches.append(batch)
        return self.accept

    @property
    def events(self) -> list[object]:
        return [e for b in self.batches for e in b.events]


def make_engine(
    model: DecoderModel, num_blocks: int, sink: ListSink | None = None, **config: int | bool
) -> Engine:
    """An engine over ``num_blocks`` blocks (one is the null block); ``config``: EngineConfig."""
    kv = KVCacheManager(KVCacheConfig(num_blocks, BLOCK_SIZE, enable_kv_cache_events=True))
    return Engine(
        model,
        model.make_cache(num_blocks, BLOCK_SIZE),
        kv,
        EngineConfig(**config),
        event_sink=sink,
        eos_token_id=256,
    )


class Outputs:
    """An output callback that keeps every request's outputs, in order."""

    def __init__(self) -> None:
        self.by_id: dict[str, list[RequestOutput]] = {}

    def __call__(self, out: RequestOutput) -> None:
        self.by_id.setdefault(out.request_id, []).append(out)

    def tokens(self, request_id: str) -> list[int]:
        return [t for out in self.by_id[request_id] for t in out.new_token_ids]

    def last(self, request_id: str) -> RequestOutput:
        return self.by_id[request_id][-1]


def run_until_idle(engine: Engine) -> int:
    """Take the inbox and step until no work is left; returns the number of steps."""
    engine.run_inbox(block=False)
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < 10_000
    return steps


def salted_prompt(length: int, salt: int) -> list[int]:
    """``length`` token ids, the same for the same ``salt``."""
    return [(13 * i + 29 * salt + 1) % 256 for i in range(length)]
