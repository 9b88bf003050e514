"""Sampling: the parameters of one request, their limits, and drawing tokens from logits.

The limits follow vLLM's (and OpenAI's) so a body that vLLM accepts behaves the same here:

* ``temperature`` is finite and in ``[0, 2]``; 0 is greedy. A positive temperature below
  :data:`MIN_TEMPERATURE` is raised to it when sampling (vLLM does the same): dividing
  logits by 1e-40 overflows float32 and the softmax turns to NaN.
* ``top_p`` is in ``(0, 1]`` (1: off); ``top_k`` is -1 or 0 (off) or at least 1, and a
  ``top_k`` above the vocabulary keeps every token.
* ``seed`` fits a signed 64-bit integer (vLLM's bound); -1 means no seed, as in vLLM.
* ``logprobs`` (the number of likeliest alternatives reported with each sampled token) is
  in ``[0, MAX_LOGPROBS]``, vLLM's default ``max_logprobs``. Like vLLM's default
  (``raw_logprobs``), they are the log-softmax of the model's logits before temperature,
  top-k and top-p.

Drawing never lets one request's numbers take the batch down: each row that cannot be
sampled (non-finite logits from the model, or a draw that fails) comes back as a
:class:`SamplingError` for that request alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from pool.errors import InvalidRequestError, PoolError
from pool.worker.outputs import TokenLogprobs

__all__ = [
    "MAX_LOGPROBS",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "SEED_MAX",
    "SEED_MIN",
    "Sampler",
    "SamplingError",
    "SamplingParams",
    "token_logprobs",
]

MIN_TEMPERATURE: Final = 0.01
"""The smallest temperature sampled with (vLLM's ``_MAX_TEMP`` floor); lower ones are raised."""
MAX_TEMPERATURE: Final = 2.0
"""The largest temperature accepted (vLLM's and OpenAI's bound)."""
SEED_MIN: Final = -(2**63)
"""The smallest seed accepted (a signed 64-bit integer, as vLLM's API)."""
SEED_MAX: Final = 2**63 - 1
"""The largest seed accepted."""
MAX_LOGPROBS: Final = 20
"""The most alternatives a request may ask logprobs of (vLLM's default ``max_logprobs``)."""
_NO_SEED: Final = -1
"""A seed of -1 asks for no seed (vLLM's convention)."""


class SamplingError(PoolError, ArithmeticError):
    """One request's row of logits could not be sampled; the request fails, not the batch."""


@dataclass(frozen=True)
class SamplingParams:
    """How to generate the tokens of one request.

    Attributes:
        max_tokens: Tokens to generate at most (at least 1).
        temperature: 0 for greedy decoding, else the softmax temperature (at most
            :data:`MAX_TEMPERATURE`; sampled with at least :data:`MIN_TEMPERATURE`).
        ignore_eos: Keep generating after the end-of-sequence token.
        seed: Seed of this request's sampler; ``None`` or -1 use the engine's generator.
        top_p: Sample from the smallest set of tokens whose probability reaches it
            (nucleus sampling); 1 keeps every token.
        top_k: Sample from the ``top_k`` likeliest tokens; 0 or -1 keep every token.
        logprobs: Report each sampled token's log probability and those of the
            ``logprobs`` likeliest tokens; ``None``: none reported.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None
    top_p: float = 1.0
    top_k: int = 0
    logprobs: int | None = None

    def check(self) -> None:
        """Reject values outside the limits in this module's docstring.

        Raises:
            InvalidRequestError: The first value out of range, with the range it must be in.
        """
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature):
            raise InvalidRequestError(
                f"temperature must be a finite number, got {self.temperature}"
            )
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be at most {MAX_TEMPERATURE}, got {self.temperature}"
            )
        if not (0.0 < self.top_p <= 1.0):  # also refuses NaN
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (all tokens) or at least 1, got {self.top_k}"
            )
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidRequestError(
                f"seed must be a signed 64-bit integer ({SEED_MIN} to {SEED_MAX}), got {self.seed}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )

    @property
    def is_greedy(self) -> bool:
        """Whether the likeliest token is taken (temperature 0)."""
        return self.temperature == 0

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        """This request's own generator: seeded when sampling with a seed, else ``None``."""
        if self.is_greedy or self.seed is None or self.seed == _NO_SEED:
            return None
        # manual_seed takes the 64-bit pattern: a negative seed is the same as seed + 2**64.
        return torch.Generator(device=device).manual_seed(self.seed % 2**64)


class Sampler:
    """Draws the next token of each request from its row of logits.

    Args:
        generator: Used by requests without their own generator.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self._generator = generator

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int | SamplingError]:
        """One token per row of ``logits`` (``[rows, vocab]``), or the error of that row.

        Args:
            logits: The rows, in the order of ``params``.
            params: Each row's sampling parameters (already :meth:`~SamplingParams.check`\\ ed).
            generators: Each row's own generator, or ``None`` for the shared one.

        Returns:
            Per row, the token id or the :class:`SamplingError` that fails its request.
        """
        if not params:
            return []
        finite: list[bool] = torch.isfinite(logits).all(-1).tolist()
        greedy: list[int] = logits.argmax(-1).tolist()
        tokens: list[int | SamplingError] = []
        for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
            if not finite[row]:
                tokens.append(
                    SamplingError(
                        "the model produced non-finite logits (NaN or infinity) for this "
                        "request; its weights or inputs overflow the model's dtype"
                    )
                )
            elif p.is_greedy:
                tokens.append(greedy[row])
            else:
                try:
                    tokens.append(self._draw(logits[row], p, generator or self._generator))
                except SamplingError as exc:
                    tokens.append(exc)
                except RuntimeError as exc:  # torch refused the draw
                    tokens.append(SamplingError(f"sampling failed: {exc}"))
        return tokens

    @staticmethod
    def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
        # The row is finite; with the temperature floored, row / t stays finite in float32
        # for any logit below ~3e36, and softmax subtracts the maximum first.
        scaled = row.float() / max(p.temperature, MIN_TEMPERATURE)
        vocab = scaled.shape[-1]
        if 0 < p.top_k < vocab:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, -math.inf)
        probs = torch.softmax(scaled, -1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep a token while the probability before it is below top_p, and always the
            # likeliest one: a top_p below float32's range (1e-300) compares as 0.
            before = torch.cumsum(sorted_probs, -1) - sorted_probs
            drop = before >= p.top_p
            drop[0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        # Checked here, not left to multinomial: on CUDA a NaN reaches a device-side assert
        # that poisons the whole context, not just this request.
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
            raise SamplingError(
                f"sampling failed: the probabilities at temperature {p.temperature} are not "
                "finite (a logit overflows float32 once divided by the temperature)"
            )
        return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """The log probability of ``token_id`` and of the ``num_top`` likeliest tokens.

    Args:
        row: One request's logits (``[vocab]``, finite), before any sampling transform.
        token_id: The sampled token.
        num_top: How many of the likeliest tokens to report (at most the vocabulary).
    """
    logprobs = torch.log_softmax(row.float(), -1)
    top = torch.topk(logprobs, min(num_top, logprobs.shape[-1])) if num_top else None
    top_pairs: list[tuple[int, float]] = []
    if top is not None:
        top_pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprobs(token_id, float(logprobs[token_id]), tuple(top_pairs))
