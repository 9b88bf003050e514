"""Serving one completion or chat request: its choices run on the engine, its answer goes out.

Each choice (``n`` per prompt, every prompt of a batch) is one engine request; their
outputs meet in one queue. A choice ends when the engine finishes it (end of sequence:
``"stop"``, ``max_tokens``: ``"length"``) or when a stop string appears in its text: the
worker then aborts its engine request (its blocks stay cached) and reports ``"stop"``.

Failures: a choice that fails in the engine fails the request (500 ``request_failed``;
503 ``unavailable`` when the engine stopped); its other choices are aborted. Once a stream
has started, the error is its last event (``data: {"error": ...}``), then ``data:
[DONE]``. A client that leaves aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from events.tokenizer import Tokenizer
from pool.worker.choice_text import ChoiceText
from pool.worker.completions import CompletionRequest
from pool.worker.engine import Engine, EngineClosedError, InvalidRequestError
from pool.worker.guards import error_body, error_response
from pool.worker.outputs import RequestOutput
from pool.worker.responses import AnswerShape, ChoiceResult, usage

__all__ = ["Generation"]

logger = logging.getLogger(__name__)

_LIVENESS_CHECK_S: Final = 5.0


@dataclass
class _Choice:
    """One choice while it runs: what it produced, its text, its engine request."""

    result: ChoiceResult
    text: ChoiceText
    engine_id: str
    num_cached_tokens: int | None = None

    @property
    def done(self) -> bool:
        return self.result.finish_reason is not None


class _Failed(Exception):
    """A choice failed in the engine: the request ends with this status and error."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


class Generation:
    """Runs completion and chat requests on an engine and answers them.

    Args:
        engine: The started engine.
        tokenizer: Decodes generated tokens.
        registry: Where the request and token counters register.
        count_failure: Called with ``"engine_stopped"`` for each request the engine
            cut off by stopping.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        registry: CollectorRegistry,
        count_failure: Callable[[str], None],
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._count_failure = count_failure
        self._finished = Counter(
            "kvroute_worker_requests",
            "Choices (engine requests) finished, by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        self._tokens = Counter(
            "kvroute_worker_tokens", "Tokens served, by kind.", ["kind"], registry=registry
        )

    async def serve(
        self, request: web.Request, parsed: CompletionRequest, shape: AnswerShape
    ) -> web.StreamResponse:
        """Run every choice of ``parsed`` and answer (a stream when it asked for one)."""
        try:
            for c in range(parsed.num_choices):
                self.engine.validate(parsed.prompt_of(c), parsed.choice_params(c))
        except InvalidRequestError as exc:
            return error_response(400, str(exc))
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        choices = [
            _Choice(ChoiceResult(c), ChoiceText(self.tokenizer, parsed.stop), f"{shape.id}-{c}")
            for c in range(parsed.num_choices)
        ]
        if parsed.params.logprobs is not None:
            for choice in choices:
                choice.result.logprobs = []
        try:
            for c, choice in enumerate(choices):

                def deliver(out: RequestOutput, c: int = c) -> None:
                    loop.call_soon_threadsafe(outputs.put_nowait, (c, out))

                self.engine.submit(
                    choice.engine_id,
                    parsed.prompt_of(c),
                    parsed.choice_params(c),
                    deliver,
                    cache_salt=parsed.cache_salt,
                )
        except EngineClosedError as exc:
            self._abort_running(choices)
            return error_response(503, str(exc), "unavailable")
        finished = False
        try:
            if parsed.stream:
                response = await self._stream(request, parsed, shape, choices, outputs)
            else:
                response = await self._whole(parsed, shape, choices, outputs)
            finished = True
            return response
        finally:
            if not finished:  # the client went away (or the handler failed)
                self._abort_running(choices, "abort")

    def _abort_running(self, choices: list[_Choice], count_as: str | None = None) -> None:
        for choice in choices:
            if not choice.done:
                choice.result.finish_reason = "abort"
                self.engine.abort(choice.engine_id)
                if count_as is not None:
                    self._finished.labels(count_as).inc()

    async def _whole(
        self,
        parsed: CompletionRequest,
        shape: AnswerShape,
        choices: list[_Choice],
        outputs: asyncio.Queue[tuple[int, RequestOutput]],
    ) -> web.Response:
        try:
            async for _ in self._progress(choices, outputs):
                pass
        except _Failed as failed:
            return web.json_response(failed.body, status=failed.status)
        for choice in choices:
            choice.result.text = choice.text.text
        return web.json_response(
            shape.whole([c.result for c in choices], self._usage(parsed, choices))
        )

    async def _stream(
        self,
        request: web.Request,
        parsed: CompletionRequest,
        shape: AnswerShape,
        choices: list[_Choice],
        outputs: asyncio.Queue[tuple[int, RequestOutput]],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.headers["Cache-Control"] = "no-cache"
        await response.prepare(request)

        async def send(chunk: dict[str, Any]) -> None:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        if shape.endpoint == "chat":
            for c in range(len(choices)):
                await send(shape.role_chunk(c))
        try:
            async for c, delta, out in self._progress(choices, outputs):
                result = choices[c].result
                logprobs = None if result.logprobs is None else out.logprobs or ()
                await send(
                    shape.delta_chunk(
                        c, delta, out.new_token_ids, logprobs,
                        result.finish_reason, result.stop_reason,
                    )
                )  # fmt: skip
            if parsed.include_usage:
                await send(shape.usage_chunk(self._usage(parsed, choices)))
        except _Failed as failed:  # the status line is sent: the error is the last event
            await send(failed.body)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _progress(
        self, choices: list[_Choice], outputs: asyncio.Queue[tuple[int, RequestOutput]]
    ) -> AsyncIterator[tuple[int, str, RequestOutput]]:
        """Apply each engine output to its choice; yields ``(choice, text that may be sent
        now, the output)``.

        Raises:
            _Failed: A choice failed (the others are aborted).
        """
        async for c, out in self._outputs(choices, outputs):
            choice = choices[c]
            if choice.done:
                continue  # outputs of a choice stopped by a stop string, still in flight
            if out.finish_reason in ("error", "abort"):
                self._count(out, out.finish_reason)
                self._abort_running(choices)
                raise _Failed(*self._failure(out))
            if choice.num_cached_tokens is None:
                choice.num_cached_tokens = out.num_cached_tokens
            delta = choice.text.push(out.new_token_ids, out.finished)
            result = choice.result
            result.token_ids.extend(out.new_token_ids)
            if result.logprobs is not None and out.logprobs is not None:
                result.logprobs.extend(out.logprobs)
            if choice.text.stopped:
                result.finish_reason, result.stop_reason = "stop", choice.text.stop_reason
                if not out.finished:
                    self.engine.abort(choice.engine_id)
                self._count(out, "stop")
            elif out.finished:
                result.finish_reason = out.finish_reason
                self._count(out, out.finish_reason or "")
            yield c, delta, out

    async def _outputs(
        self, choices: list[_Choice], outputs: asyncio.Queue[tuple[int, RequestOutput]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The choices' outputs until each is done; an ``"abort"`` if the engine dies."""
        while not all(c.done for c in choices):
            try:
                yield await asyncio.wait_for(outputs.get(), _LIVENESS_CHECK_S)
            except asyncio.TimeoutError:
                if self.engine.is_running or not outputs.empty():
                    continue
                running = next(i for i, c in enumerate(choices) if not c.done)
                logger.error("the engine loop is gone; aborting request %s", choices[0].engine_id)
                yield running, RequestOutput(choices[running].engine_id, [], "abort", 0, 0, 0)

    def _failure(self, out: RequestOutput) -> tuple[int, dict[str, Any]]:
        """Status and JSON error of a choice the engine failed or cut off."""
        if out.finish_reason == "error":
            assert out.failure is not None
            message = (
                f"this request failed in the worker's engine ({out.failure.stage}): "
                f"{out.failure.message}; the worker and its other requests go on"
            )
            return 500, error_body(message, "request_failed")
        self._count_failure("engine_stopped")
        return 503, error_body("the request was aborted: the engine stopped", "unavailable")

    def _count(self, out: RequestOutput, reason: str) -> None:
        self._finished.labels(reason).inc()
        self._tokens.labels("prompt").inc(out.num_prompt_tokens)
        self._tokens.labels("generated").inc(out.num_output_tokens)

    @staticmethod
    def _usage(parsed: CompletionRequest, choices: list[_Choice]) -> dict[str, Any]:
        # Each prompt counts once; its cached tokens are its first choice's (the others
        # may find what the first one computed).
        cached = sum(
            choices[p * parsed.n].num_cached_tokens or 0 for p in range(len(parsed.prompts))
        )
        return usage(
            sum(len(p) for p in parsed.prompts),
            sum(len(c.result.token_ids) for c in choices),
            cached,
        )
