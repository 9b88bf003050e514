"""``kvroute explain``: why one request goes (or went) where it does, from an event log.

It rebuilds the index at ``--at`` (as ``kvroute replay --memory`` does), scores the prompt
on every worker the log knows with the real policy, and prints each worker's matched
prefix, load and cost, the pick and the reason. With ``--decisions`` (the router's
``--decision-log``) it also shows what the router did for a prompt of that length at or
before that moment, and whether the replayed state agrees with what the router saw.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import msgspec

from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.recorder import EventLogError
from events.tokenizer import TokenizerError, load_tokenizer
from router.cli.replay import add_replay_arguments, run_offline
from router.cli.router_config import config_from_args
from router.cli.router_flags import build_parser
from router.errors import RouterError
from router.index.memory import MemoryPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.offline.explain import Explanation, explain_request, find_decision, read_decisions
from router.offline.replay import LogSpan, ReplayError, format_ts, log_span, parse_at, replay_log
from router.routing.policies import DEFAULT_POLICY, POLICY_NAMES

__all__ = ["explanation_json", "explanation_text", "main", "read_token_file"]

_LOG: Final = logging.getLogger("kvroute.explain")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute explain",
        description="Rebuild the prefix index at one moment of a `kvroute record` log and "
        "explain the routing of one prompt: every worker's matched prefix, load and cost, "
        "the worker the policy picks and why; with the router's decision log, what the "
        "router did and whether the replayed state agrees.",
    )
    add_replay_arguments(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt as text (tokenized)")
    prompt.add_argument(
        "--tokens",
        type=Path,
        metavar="FILE",
        help="the prompt as token ids: a JSON list, or integers separated by spaces/commas",
    )
    p.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="tokenizer.json or model directory for --prompt, encoded as the router encodes a "
        "completion's text (special tokens included) (default: the byte-level tokenizer "
        "workers use)",
    )
    p.add_argument(
        "--decisions",
        type=Path,
        metavar="FILE",
        help="the router's --decision-log: compare with what it did",
    )
    p.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        help="policy to explain (default: the recorded decision's, else --router-args's, "
        f"else {DEFAULT_POLICY})",
    )
    p.add_argument(
        "--router-args",
        default="",
        metavar="'FLAGS'",
        help="the `kvroute router` flags the router ran with, quoted (e.g. '--config "
        "router.toml --prefill-weight 4'), so costs are scored with its weights (default: "
        "the weights the --decisions record holds, else the defaults)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        help="tokens per block (default: the log's BlockStored block size, else 16)",
    )
    p.add_argument(
        "--workers",
        help="comma-separated candidate workers (default: every worker in the log)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=0, help="the request's max_tokens (decode load)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def read_token_file(path: Path) -> list[int]:
    """Token ids from a file: a JSON list, or integers separated by whitespace or commas.

    Raises:
        ReplayError: The file holds anything else.
    """
    text = path.read_text().strip()
    try:
        value = (
            json.loads(text)
            if text.startswith("[")
            else [int(t) for t in text.replace(",", " ").split()]
        )
    except ValueError as exc:
        raise ReplayError(f"{path}: expected token ids ({exc})") from exc
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ReplayError(f"{path}: expected a list of non-negative integer token ids")
    return value


def explanation_json(exp: Explanation, span: LogSpan) -> dict[str, Any]:
    """The explanation as one JSON object (``cost``: the cost terms, cost-based policies)."""
    costs = exp.costs
    out: dict[str, Any] = {
        "at": exp.at_ts,
        "at_iso": format_ts(exp.at_ts),
        "since_first_record_s": exp.at_ts - span.first_ts,
        "num_prompt_tokens": exp.num_prompt_tokens,
        "block_size": exp.block_size,
        "policy": exp.decision.policy,
        "worker_id": exp.decision.worker_id,
        "reason": exp.reason,
        "candidates": [
            {
                "worker_id": c.worker_id,
                "matched_tokens": c.matched_tokens,
                "predicted_tokens": c.predicted_tokens,
                "num_requests": c.load.num_requests,
                "queued_prefill_tokens": c.load.queued_prefill_tokens,
                "decode_tokens": c.load.decode_tokens,
                "score": c.score,
                **({"cost": msgspec.to_builtins(costs[c.worker_id])} if costs else {}),
            }
            for c in exp.decision.candidates
        ],
    }
    if exp.decision.weights is not None:
        out["weights"] = msgspec.to_builtins(exp.decision.weights)
    if exp.recorded is not None:
        out["router"] = {
            "ts": exp.recorded.ts,
            "worker_id": exp.recorded.worker_id,
            "policy": exp.recorded.policy,
            "index_live": exp.recorded.index_live,
            "agrees": exp.agrees,
            "disagreements": exp.disagreements,
        }
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Fixed-width lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return [
        "  ".join(
            c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)
        ).rstrip()
        for r in (header, *rows)
    ]


def _cost_lines(exp: Explanation) -> list[str]:
    """The cost terms each candidate was scored with, and the weights (cost policies)."""
    weights = exp.decision.weights
    costs = exp.costs
    if weights is None or not costs:
        return []
    first = next(iter(costs.values()))
    names = [name for name, _, _ in first.terms(weights)]
    formula = " + ".join(f"{w:g} x {name}" for name, _, w in first.terms(weights))
    formula += " (share: by how much the worker's recent share of work would exceed the mean)"
    rows = [
        (
            c.worker_id,
            f"{costs[c.worker_id].cached_tokens:,.0f}",
            *(
                f"{amount:.3f}" if name == "share" else f"{amount:,.0f}"
                for name, amount, _ in costs[c.worker_id].terms(weights)
            ),
            f"{c.score:,.1f}",
        )
        for c in exp.decision.candidates
    ]
    return [
        "",
        f"cost in tokens of work: score = {formula}",
        *_table(("worker", "cached", *names, "score"), rows),
    ]


def explanation_text(exp: Explanation, span: LogSpan) -> str:
    """The explanation as a table and a few sentences, then the cost terms."""
    blocks = exp.num_prompt_tokens // exp.block_size
    lines = [
        f"request: {exp.num_prompt_tokens} prompt tokens ({blocks} full blocks of "
        f"{exp.block_size}); index replayed to {format_ts(exp.at_ts)} "
        f"({exp.at_ts - span.first_ts:+.3f} s from the first record)",
        "",
    ]
    header = ("worker", "matched", "predicted", "requests", "queued", "decode", "score", "")
    rows = [
        (
            c.worker_id,
            str(c.matched_tokens),
            str(c.predicted_tokens),
            str(c.load.num_requests),
            str(c.load.queued_prefill_tokens),
            str(c.load.decode_tokens),
            f"{c.score:,.1f}",
            "<- picked" if c.worker_id == exp.decision.worker_id else "",
        )
        for c in exp.decision.candidates
    ]
    lines += _table(header, rows)
    lines += ["", f"why: {exp.reason}"]
    recorded = exp.recorded
    if recorded is not None:
        verdict = (
            "the replayed state agrees."
            if exp.agrees
            else "the replayed state disagrees: " + "; ".join(exp.disagreements) + "."
        )
        degraded = "" if recorded.index_live else " with its index degraded (load only)"
        lines.append(
            f"router: at {format_ts(recorded.ts)} ({exp.at_ts - recorded.ts:.3f} s before the "
            f"replayed moment) it chose {recorded.worker_id} ({recorded.policy}){degraded}; "
            + verdict
        )
    return "\n".join(lines + _cost_lines(exp))


def _candidates(args: argparse.Namespace, in_log: Sequence[str]) -> list[WorkerId]:
    if args.workers:
        return [WorkerId(w.strip()) for w in args.workers.split(",") if w.strip()]
    return [WorkerId(w) for w in sorted(in_log)]


async def _run(args: argparse.Namespace) -> int:
    if args.tokens is not None:
        token_ids = read_token_file(args.tokens)
    else:
        # As the router keys a completion's text: with the tokenizer's special tokens.
        token_ids = load_tokenizer(args.tokenizer).encode(args.prompt, add_special_tokens=True)
    span = log_span(args.log)
    at_ts = parse_at(args.at, span)
    keyer = RouterKeyer(args.seed)
    index = BridgedIndex(MemoryPrefixIndex(), keyer)
    summary = await replay_log(args.log, at_ts, index)
    sizes = {w.block_size for w in summary.workers.values() if w.block_size is not None}
    block_size = args.block_size or (sizes.pop() if len(sizes) == 1 else 16)
    workers = _candidates(args, list(summary.workers))
    if not workers:
        raise ReplayError(f"no worker has events in {args.log} at or before {args.at}")
    recorded = (
        find_decision(read_decisions(args.decisions), at_ts, len(token_ids))
        if args.decisions is not None
        else None
    )
    router = config_from_args(
        build_parser().parse_args(shlex.split(args.router_args)), redis_url=""
    )
    policy = args.policy or (recorded.policy if recorded is not None else router.policy)
    config = router.policy_config
    if recorded is not None and recorded.weights is not None and not args.router_args:
        config = replace(config, weights=recorded.weights)  # what the router scored with
    exp = await explain_request(
        index.store,
        token_ids,
        workers,
        at_ts=at_ts,
        policy=policy,
        config=config,
        block_size=block_size,
        keyer=keyer,
        num_output_tokens=args.max_tokens,
        recorded=recorded,
    )
    if args.json:
        print(json.dumps(explanation_json(exp, span), indent=2))
    else:
        print(explanation_text(exp, span))
    if args.decisions is not None and recorded is None:
        _LOG.warning(
            "no decision for a %d-token prompt at or before %s in %s",
            len(token_ids), format_ts(at_ts), args.decisions,
        )  # fmt: skip
    return 0


def main(argv: Sequence[str]) -> int:
    """Run ``kvroute explain``; returns the exit code."""
    errors = (RouterError, EventLogError, TokenizerError, OSError)
    return run_offline(_parser(), argv, _run, errors, _LOG)
