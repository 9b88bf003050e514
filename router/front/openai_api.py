"""The router's OpenAI endpoints: completions, chat completions, route, models.

Each request is routed among the workers serving its ``model``
(:meth:`RouterService.select_model`), keyed from the model's exact token ids
(:mod:`router.front.tokenization`), and forwarded as the client sent it, byte for byte, to
the same endpoint of the chosen worker; a stream is only asked for its usage, which the
client gets only if it asked (:mod:`router.front.stream_usage`). A batch prompt is split,
each prompt routed on its own prefix, and the answers merged (:mod:`router.front.batch`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from router.front.api_requests import ApiError, decode_body, read_body
from router.front.batch import merge_answers, prompt_body
from router.front.bodies import CompletionBody, RequestBody, RouteBody, decode_token_ids_body
from router.front.chat import ChatBody, chat_problem
from router.front.hops import hop_refusal, next_hops
from router.front.identity import context_of
from router.front.proxy_contracts import ProxyResult, WorkersUnavailableError
from router.front.request_context import session_key
from router.front.route_answer import listed_candidates, requested_top_k
from router.front.served import RequestTiming, ServedRequest
from router.front.stream_usage import UsageStripper, ask_for_usage, usage_asked
from router.front.tokenization import PromptError
from router.front.worker_answers import WORKER_HEADER
from router.workers.registry import WorkerRecord

if TYPE_CHECKING:
    from router.front.decisions import Routed
    from router.front.service import RouterService

__all__ = ["OpenAIHandlers"]


class OpenAIHandlers:
    """The OpenAI endpoints' handlers, bound to one :class:`RouterService`."""

    def __init__(self, service: RouterService) -> None:
        self.svc = service
        self.limits = service.config.limits

    def check_hops(self, request: web.Request) -> str:
        """The hop header to forward with; 508 for a request that looped back here."""
        replica_id = self.svc.replica_id
        refusal = hop_refusal(request.headers, replica_id)
        if refusal is not None:
            raise ApiError(508, refusal, "loop_detected")
        return next_hops(request.headers, replica_id)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        if not tokens:
            raise ApiError(400, "prompt is empty: send at least one token")
        if len(tokens) > self.limits.max_prompt_tokens:
            raise ApiError(
                400,
                f"prompt has {len(tokens)} tokens; the limit is {self.limits.max_prompt_tokens}",
            )

    async def _prompt_tokens(
        self,
        model: str | None,
        prompt: str | list[int],
        body: CompletionBody,
        workers: Sequence[WorkerRecord],
    ) -> list[int]:
        """A prompt's token ids; empty when they cannot be known (routed on load alone)."""
        if isinstance(prompt, list):
            tokens: list[int] | None = prompt
        else:
            try:
                tokens = await self.svc.tokenizer.prompt_tokens(
                    model, prompt, body.add_special_tokens, workers
                )
            except PromptError as exc:
                raise ApiError(400, str(exc)) from exc
        if tokens is None:
            return []
        self._check_tokens(tokens)
        return tokens

    def _check_output(self, body: RequestBody) -> None:
        if body.max_tokens is not None and body.max_tokens > self.limits.max_output_tokens:
            raise ApiError(
                400,
                f"max_tokens {body.max_tokens} exceeds the limit {self.limits.max_output_tokens}",
            )

    async def _decide(
        self,
        request: web.Request,
        tokens: list[int],
        body: RequestBody,
        session: str | None,
        *,
        record: bool = True,
    ) -> Routed:
        """The service's decision for one prompt, traced (span ``kvroute.decide``)."""
        ctx = context_of(request)
        tracing = self.svc.tracing
        with tracing.child_span(ctx, "kvroute.decide") as span:
            routed = await self.svc.decide(
                tokens, body.output_tokens, cache_salt=body.cache_salt, record=record,
                model=body.model, context=ctx, session=session,
            )  # fmt: skip
            if span is not None:  # no attributes built while tracing is off
                chosen = routed.chosen
                tracing.annotate(span, {
                    "kvroute.worker": chosen.worker_id, "kvroute.policy": routed.decision.policy,
                    "kvroute.prompt_tokens": len(tokens),
                    "kvroute.matched_tokens": chosen.matched_tokens,
                    "kvroute.predicted_tokens": chosen.predicted_tokens,
                })  # fmt: skip
        return routed

    async def _forward(
        self,
        request: web.Request,
        path: str,
        routed: Routed,
        raw: bytes,
        body: RequestBody,
        *,
        hops: str,
        session: str | None,
    ) -> tuple[web.StreamResponse, ProxyResult]:
        """Forward the client's body to ``path`` of the routed workers, traced (span
        ``kvroute.proxy``), and record the answered request (:mod:`router.front.served`).

        A stream is asked for its usage (the router counts prefix hits from it), which
        the client gets only when it asked.
        """
        rewriter = None
        if body.streams and not usage_asked(body.stream_options):
            raw, rewriter = ask_for_usage(raw, body.stream_options), UsageStripper()
        svc = self.svc
        ctx = context_of(request)
        timing = RequestTiming(svc.accounting(routed), ctx.received_s)
        with svc.tracing.child_span(ctx, "kvroute.proxy") as span:
            headers = ctx.forwarded_headers(svc.tracing.traceparent(span))
            try:
                response, result = await svc.proxy.forward(
                    request, path, raw, routed.targets, timing, rewriter,
                    hops=hops, headers=headers,
                )  # fmt: skip
            except WorkersUnavailableError as exc:
                if exc.timed_out:
                    raise ApiError(504, str(exc), "timeout") from exc
                raise ApiError(502, str(exc), "worker_unavailable") from exc
            if span is not None:
                svc.tracing.annotate(span, {
                    "kvroute.worker": result.worker_id, "kvroute.attempts": result.num_attempts,
                    "http.response.status_code": result.status,
                })  # fmt: skip
        if result.client_aborted:
            svc.metrics.client_aborts.labels("answer").inc()
        served = ServedRequest(
            routed.decision, routed.num_prompt_tokens, result, timing, body.streams,
            body.model, session,
        )  # fmt: skip
        svc.served.record(served)
        return response, result

    async def completions(self, request: web.Request) -> web.StreamResponse:
        hops = self.check_hops(request)
        raw = await read_body(request, self.limits)
        body = decode_token_ids_body(raw, CompletionBody) or decode_body(raw, CompletionBody)
        self._check_output(body)
        try:
            prompts = body.prompts()
        except ValueError as exc:
            raise ApiError(400, str(exc), extra={"param": "prompt", "code": None}) from exc
        model, workers = self.svc.select_model(body.model)
        session = session_key(request.headers, body.user)
        if len(prompts) > 1:
            return await self._batch(
                request, raw, body, prompts, (model, workers), hops=hops, session=session
            )
        tokens = await self._prompt_tokens(model, prompts[0], body, workers)
        routed = await self._decide(request, tokens, body, session)
        response, _ = await self._forward(
            request, "/v1/completions", routed, raw, body, hops=hops, session=session
        )
        return response

    async def _batch(
        self,
        request: web.Request,
        raw: bytes,
        body: CompletionBody,
        prompts: list[str | list[int]],
        selected: tuple[str | None, Sequence[WorkerRecord]],
        *,
        hops: str,
        session: str | None,
    ) -> web.StreamResponse:
        """A batch prompt: each prompt routed and forwarded on its own, answers merged.

        Args:
            request: The client's request.
            raw: Its body.
            body: Its fields.
            prompts: The prompts of the batch.
            selected: The model and its workers (:meth:`RouterService.select_model`).
            hops: The hop header to forward with.
            session: The request's session key, if any.
        """
        if body.streams:
            raise ApiError(
                400,
                f"a batch prompt ({len(prompts)} prompts) cannot be streamed through the "
                "router: stream one request per prompt, or send the batch without stream",
                extra={"param": "stream", "code": None},
            )
        decoded = msgspec.json.decode(raw)
        model, workers = selected

        async def one(prompt: str | list[int]) -> tuple[web.StreamResponse, ProxyResult]:
            tokens = await self._prompt_tokens(model, prompt, body, workers)
            routed = await self._decide(request, tokens, body, session)
            sub = prompt_body(decoded, prompt)
            return await self._forward(
                request, "/v1/completions", routed, sub, body, hops=hops, session=session
            )

        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        bodies = []
        for response, _ in answers:
            if response.status != 200 or not isinstance(response, web.Response):
                return response  # the first failure, in prompt order, is the answer
            bodies.append(msgspec.json.decode(_body_of(response)))
        merged = merge_answers(bodies, body.n or 1)
        served = ",".join(result.worker_id for _, result in answers)
        return web.Response(
            body=msgspec.json.encode(merged),
            content_type="application/json",
            headers={WORKER_HEADER: served},
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        hops = self.check_hops(request)
        raw = await read_body(request, self.limits)
        body: ChatBody = decode_body(raw, ChatBody)
        problem = chat_problem(body, self.limits.max_messages)
        if problem is not None:
            raise ApiError(400, problem, extra={"param": "messages", "code": None})
        self._check_output(body)
        model, workers = self.svc.select_model(body.model)
        try:
            tokens = await self.svc.tokenizer.chat_tokens(model, msgspec.json.decode(raw), workers)
        except PromptError as exc:
            raise ApiError(400, str(exc), extra={"param": "messages", "code": None}) from exc
        if tokens is not None:
            self._check_tokens(tokens)
        session = session_key(request.headers, body.user)
        routed = await self._decide(request, tokens or [], body, session)
        path = "/v1/chat/completions"
        response, _ = await self._forward(
            request, path, routed, raw, body, hops=hops, session=session
        )
        return response

    async def route(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.limits)
        body = decode_token_ids_body(raw, RouteBody) or decode_body(raw, RouteBody)
        self._check_output(body)
        top_k = requested_top_k(request.query, body.top_k)
        try:
            prompts = body.prompts()
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        if len(prompts) != 1:
            raise ApiError(400, f"POST /v1/route takes one prompt, got a batch of {len(prompts)}")
        model, workers = self.svc.select_model(body.model)
        tokens = await self._prompt_tokens(model, prompts[0], body, workers)
        session = session_key(request.headers, body.user)
        routed = await self._decide(request, tokens, body, session, record=not body.dry_run)
        decision = routed.decision
        if not body.dry_run:
            await self.svc.hold(routed)
            self.svc.served.remember_session(session, decision.worker_id)
        answer = {
            "worker_id": decision.worker_id,
            "url": routed.targets[0].url,
            "matched_tokens": routed.chosen.matched_tokens,
            "candidates": listed_candidates(decision, top_k),
            "num_candidates": len(decision.candidates),
        }
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: every model a worker serves, OpenAI's list shape."""
        listing = {"object": "list", "data": self.svc.models.listing(self.svc.proxied())}
        return web.Response(body=msgspec.json.encode(listing), content_type="application/json")


def _body_of(response: web.Response) -> bytes:
    body = response.body
    return body if isinstance(body, bytes) else b""
