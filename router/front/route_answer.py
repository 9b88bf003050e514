"""How many candidates a ``POST /v1/route`` answer lists: the best few unless asked for all.

At 1,000 workers every candidate's entry made an answer of ~150 KB, though a gateway
needs the chosen worker and a few fallbacks. The answer lists the best
:data:`DEFAULT_TOP_K` by default, best first (the chosen one, then the others by
score, as :meth:`router.routing.policies.Decision.ranked` orders them); ``?top_k=N`` or
``"top_k": N`` in the body asks for N, ``?candidates=all`` for every one.
``"num_candidates"`` always says how many there were.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from router.front.api_requests import ApiError
from router.routing.policies import CandidateScore, Decision

__all__ = ["DEFAULT_TOP_K", "listed_candidates", "requested_top_k"]

DEFAULT_TOP_K: Final = 8
"""Candidates an answer lists unless asked otherwise."""


def requested_top_k(query: Mapping[str, str], body_top_k: int | None) -> int | None:
    """How many candidates the request asks for (``None``: all of them).

    The query wins over the body. ``candidates=all`` asks for all, ``top_k=N`` (query or
    body, N >= 1) for N; neither: :data:`DEFAULT_TOP_K`.

    Raises:
        ApiError: 400 for another ``candidates`` value or a ``top_k`` that is not a
            positive integer.
    """
    listing = query.get("candidates")
    if listing is not None:
        if listing != "all":
            raise ApiError(400, f"candidates={listing!r}: the only value is 'all'")
        return None
    raw: object = query.get("top_k", body_top_k)
    if raw is None:
        return DEFAULT_TOP_K
    value = int(raw) if isinstance(raw, str) and raw.isdigit() else raw
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"top_k must be a positive integer, got {raw!r}")
    return value


def listed_candidates(decision: Decision, top_k: int | None) -> tuple[CandidateScore, ...]:
    """The candidates an answer lists: the best ``top_k`` (``None``: all), best first."""
    ranked = decision.ranked()
    return ranked if top_k is None else ranked[:top_k]
