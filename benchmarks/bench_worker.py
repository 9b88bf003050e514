"""Benchmark: the compute a prefix-cache hit saves in the worker, and decode throughput.

Rows, all through the real engine loop (``Engine.submit`` + ``Engine.step``, the paged
model, the KVCacheManager with sha256_cbor hashing; no HTTP, no event sockets):

* prefill latency (submit to first token) of a ``--prompt-tokens`` prompt with 0 %, 50 %
  and 90 % of it already cached (cached by an earlier request, as in serving), each as a
  ratio to the 0 % row: the fraction of prefill time a hit leaves;
* the dense forward of the same prompt without any KV cache, as a reference for the
  paged path's overhead;
* decode tokens/s of one request alone and of ``--batch`` requests batched, the latter as
  a ratio to the former (what continuous batching buys).

Each repeat uses a fresh prompt, so a 0 % row never hits and a hit row hits exactly its
prefix. Figures are the median over ``--repeats`` (with the minimum beside it).

Run: ``python -m benchmarks.bench_worker`` (``--quick`` for a seconds-long smoke run;
``--device cuda`` and the model size flags for a GPU run).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.environment import describe
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.worker.engine import Engine, EngineConfig, SamplingParams
from pool.worker.model import DecoderModel, ModelConfig
from pool.worker.outputs import RequestOutput

__all__ = ["main"]

HIT_FRACTIONS = (0.0, 0.5, 0.9)


_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


class _Bench:
    """An engine over a fresh cache, driven step by step on this thread.

    Args:
        model: The model.
        num_blocks: KV cache blocks.
        block_size: Tokens per block.
        clock: ``"wall"`` or ``"cpu"`` (this process's CPU time).
    """

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, clock: str) -> None:
        kv = KVCacheManager(KVCacheConfig(num_blocks, block_size))
        self.engine = Engine(
            model,
            model.make_cache(num_blocks, block_size),
            kv,
            EngineConfig(max_num_batched_tokens=1 << 20),
        )
        self.device = model.device
        self.block_size = block_size
        self.vocab = model.config.vocab_size
        self.clock = _CLOCKS[clock]
        self._next = 0
        self.cached_tokens: list[int] = []

    def prompt(self, length: int) -> list[int]:
        """A prompt no earlier request shares a block with."""
        self._next += 1
        return [(self._next * 7919 + i * 31) % self.vocab for i in range(length)]

    def run(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Submit one request per prompt and step until they all finish."""

        def sink(out: RequestOutput) -> None:
            if out.finished:
                self.cached_tokens.append(out.num_cached_tokens)

        for prompt in prompts:
            self._next += 1
            self.engine.submit(f"r{self._next}", prompt, params, sink)
        self.engine.run_inbox(block=False)
        while self.engine.has_work:
            self.engine.step()

    def timed(self, fn: Callable[[], object]) -> float:
        """Seconds ``fn`` takes on the chosen clock, device work included."""
        self._sync()
        start = self.clock()
        fn()
        self._sync()
        return self.clock() - start

    def prefill_seconds(self, length: int, hit: float) -> float:
        """Submit-to-first-token time of a fresh prompt whose first ``hit`` part is cached."""
        prompt = self.prompt(length)
        num_cached = int(length * hit) // self.block_size * self.block_size
        if num_cached:
            # A hit needs one more token than the prefix: the last token is never a hit.
            self.run([prompt[: num_cached + 1]], SamplingParams(max_tokens=1))
        self.cached_tokens.clear()
        seconds = self.timed(lambda: self.run([prompt], SamplingParams(max_tokens=1)))
        assert self.cached_tokens == [num_cached], (self.cached_tokens, num_cached)
        return seconds

    def decode_tokens_per_s(self, batch: int, prompt_len: int, new_tokens: int) -> float:
        """Tokens/s of ``batch`` greedy requests decoding ``new_tokens`` each, prefill excluded."""
        prefill = self.timed(
            lambda: self.run(
                [self.prompt(prompt_len) for _ in range(batch)], SamplingParams(max_tokens=1)
            )
        )
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        total = self.timed(
            lambda: self.run([self.prompt(prompt_len) for _ in range(batch)], params)
        )
        # `prefill` is the same batch's prefill and first token: subtract it.
        return batch * (new_tokens - 1) / max(total - prefill, 1e-9)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _stats(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), min(samples)


def _device_text(device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return f"{where or 'cpu'}, torch threads {torch.get_num_threads()}, device {device}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_worker", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, ...)")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="prefill prompt length")
    parser.add_argument("--num-layers", type=int, default=4, help="model layers")
    parser.add_argument("--hidden-size", type=int, default=256, help="model width")
    parser.add_argument("--num-heads", type=int, default=4, help="attention heads")
    parser.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--batch", type=int, default=16, help="decode batch size")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens per decode run")
    parser.add_argument("--repeats", type=int, default=7, help="repeats per row")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (0: torch's default)"
    )
    parser.add_argument(
        "--clock",
        choices=sorted(_CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time, steadier on a shared box "
        "(meaningful on the CPU with --threads 1)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.prompt_tokens = min(args.prompt_tokens, 256)
        args.num_layers, args.hidden_size = min(args.num_layers, 2), min(args.hidden_size, 64)
        args.decode_tokens, args.repeats, args.batch = 8, 2, min(args.batch, 4)

    device = torch.device(args.device)
    config = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        dtype=args.dtype,
    )
    model = DecoderModel(config, device)
    decode_prompt = 128
    blocks_per_prompt = -(-args.prompt_tokens // args.block_size) + 1
    blocks_per_decode = -(-(decode_prompt + args.decode_tokens) // args.block_size)
    num_blocks = 1 + max(2 * blocks_per_prompt, 2 * args.batch * blocks_per_decode)
    bench = _Bench(model, num_blocks, args.block_size, args.clock)

    print("bench_worker:", describe(("torch", "msgspec", "cbor2"), extra=_device_text(device)))
    print(
        f"model: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_heads} "
        f"heads, {config.dtype}; {num_blocks} blocks of {args.block_size} tokens; "
        f"{args.repeats} repeats (median, min); {args.clock} clock"
    )
    bench.prefill_seconds(args.prompt_tokens, 0.0)  # warm-up
    bench.decode_tokens_per_s(1, decode_prompt, 4)
    samples: dict[float, list[float]] = {hit: [] for hit in HIT_FRACTIONS}
    dense: list[float] = []
    prompt = bench.prompt(args.prompt_tokens)
    for _ in range(args.repeats):  # rows interleaved so load drifts hit them alike
        for hit in HIT_FRACTIONS:
            samples[hit].append(bench.prefill_seconds(args.prompt_tokens, hit))
        dense.append(bench.timed(lambda: model.forward_dense(prompt)[-1].argmax().item()))

    base, _ = _stats(samples[0.0])
    print(f"\n| prefill of a {args.prompt_tokens}-token prompt | ms | min | ratio to 0 % |")
    print("|---|---:|---:|---:|")
    for hit in HIT_FRACTIONS:
        median, low = _stats(samples[hit])
        print(
            f"| {hit:.0%} prefix hit | {median * 1e3:.1f} | {low * 1e3:.1f} | {median / base:.2f} |"
        )
    median, low = _stats(dense)
    row = f"{median * 1e3:.1f} | {low * 1e3:.1f} | {median / base:.2f}"
    print(f"| dense forward, no KV cache | {row} |")

    single = [bench.decode_tokens_per_s(1, decode_prompt, args.decode_tokens)]
    batched = [bench.decode_tokens_per_s(args.batch, decode_prompt, args.decode_tokens)]
    for _ in range(max(1, args.repeats // 2) - 1):
        single.append(bench.decode_tokens_per_s(1, decode_prompt, args.decode_tokens))
        batched.append(bench.decode_tokens_per_s(args.batch, decode_prompt, args.decode_tokens))
    one = statistics.median(single)
    print(
        f"\n| decode ({decode_prompt}-token prompts, {args.decode_tokens} tokens each) "
        "| tokens/s | max | ratio to batch 1 |"
    )
    print("|---|---:|---:|---:|")
    for label, runs in (("batch 1", single), (f"batch {args.batch}", batched)):
        median = statistics.median(runs)
        print(f"| {label} | {median:,.0f} | {max(runs):,.0f} | {median / one:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
