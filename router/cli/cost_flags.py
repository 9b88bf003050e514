"""The cost-weight command-line flags, shared by every command that scores workers.

``kvroute router``, ``kvroute sim`` and (through the router's flags) ``kvroute explain``
take the same flags for the same :class:`router.routing.cost.CostWeights` fields, so a weight tuned
in the simulator is passed to the router unchanged.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Final, NamedTuple

from router.routing.cost import CostWeights

__all__ = ["COST_FLAGS", "CostFlag", "add_cost_arguments", "cost_weights_from"]


class CostFlag(NamedTuple):
    """One flag: its name, the ``CostWeights`` field it sets, its type and meaning."""

    flag: str
    field: str
    kind: Callable[[str], Any]
    meaning: str

    @property
    def dest(self) -> str:
        """The argparse destination (and config-file key) of the flag."""
        return self.flag.lstrip("-").replace("-", "_")


COST_FLAGS: Final = (
    CostFlag("--prefill-weight", "prefill", float,
             "cost per prompt token the worker would compute for the request"),
    CostFlag("--queued-prefill-weight", "queued_prefill", float,
             "cost per prompt token already queued on the worker"),
    CostFlag("--replicated-prefill-weight", "replicated_prefill", float,
             "cost per prompt token to compute that --replicated-holders other workers "
             "already cache (e.g. a shared system prompt)"),
    CostFlag("--replicated-holders", "replicated_holders", int,
             "how many other holders make a prefix block replicated"),
    CostFlag("--decode-weight", "decode", float,
             "cost per output token in flight on the worker, in prefill tokens"),
    CostFlag("--per-request-weight", "per_request", float,
             "cost per request in flight on the worker, in prefill tokens"),
    CostFlag("--cpu-hit-weight", "cpu_hit", float,
             "fraction of a CPU-tier hit's prefill that is saved"),
    CostFlag("--temperature", "temperature", float,
             "softmax temperature over costs, relative to the prompt length; 0 picks the "
             "cheapest"),
    CostFlag("--fair-share-weight", "fair_share", float,
             "prompt tokens (at the prefill weight) a worker pays per unit its recent share "
             "of requests or computed tokens would exceed --balance-factor x the mean; 0: off"),
    CostFlag("--balance-factor", "balance_factor", float,
             "share of the mean recent work a worker may reach before the fair-share term "
             "charges it"),
    CostFlag("--fair-share-half-life-s", "fair_share_half_life_s", float,
             "age in seconds at which a routed request counts half in the recent shares"),
)  # fmt: skip


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every cost flag; unset flags stay ``None`` so config files can fill them."""
    defaults = CostWeights()
    for f in COST_FLAGS:
        parser.add_argument(
            f.flag,
            type=f.kind,
            dest=f.dest,
            help=f"{f.meaning} (default: {getattr(defaults, f.field)})",
        )


def cost_weights_from(pick: Callable[[str, Any], Any]) -> CostWeights:
    """The weights chosen by ``pick(dest, default)`` for each flag (flag, file or default).

    Raises:
        router.routing.cost.CostConfigError: A weight is out of range.
    """
    defaults = CostWeights()
    return CostWeights(**{f.field: pick(f.dest, getattr(defaults, f.field)) for f in COST_FLAGS})
