"""The decision log: one JSON line per routing decision, read back by ``kvroute explain``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO, Any

import msgspec

from router.routing.policies import Decision

__all__ = ["DecisionLog"]


class DecisionLog:
    """Appends decisions to a file, one flushed JSON object per line.

    Each line holds ``ts``, ``worker_id``, ``policy``, ``num_prompt_tokens``,
    ``index_live``, ``candidates`` (each candidate's score and its parts), ``costs`` and
    ``weights`` (each candidate's cost terms and the weights they were scored with, so
    ``kvroute explain`` re-makes the decision), plus any extra fields the caller gives.
    Fields are only ever added, so ``kvroute explain`` reads logs of older routers too.

    Args:
        path: The file (appended to; created if missing).
    """

    def __init__(self, path: str | Path) -> None:
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 (closed by close())
        self._encoder = msgspec.json.Encoder()

    def write(
        self, decision: Decision, num_prompt_tokens: int, *, index_live: bool, **extra: Any
    ) -> None:
        """Append one decision."""
        line = self._encoder.encode(
            {
                "ts": time.time(),
                "worker_id": decision.worker_id,
                "policy": decision.policy,
                "num_prompt_tokens": num_prompt_tokens,
                "index_live": index_live,
                "candidates": decision.candidates,
                "costs": decision.costs,
                "weights": decision.weights,
                **extra,
            }
        )
        self._file.write(line + b"\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()
