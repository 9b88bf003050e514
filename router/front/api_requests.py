"""Requests of the router's HTTP API: reading their bodies, and the JSON errors they become.

Every error the API answers is OpenAI-shaped: ``{"error": {"message", "type", ...}}``
(:func:`error_response`); a handler raises :class:`ApiError` and the error middleware of
:mod:`router.front.app` answers it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from router.front.config import RequestLimits

__all__ = ["ApiError", "ClientGone", "decode_body", "error_response", "read_body"]


class ApiError(Exception):
    """A request the API answers with an error.

    Args:
        status: The HTTP status.
        message: What went wrong and what to do.
        kind: The error's ``type``.
        extra: More fields of the error object (``param``, ``code``, ...).
        close: Close the connection after answering.
    """

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        extra: dict[str, Any] | None = None,
        *,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.extra = extra or {}
        self.close = close


class ClientGone(Exception):
    """The client closed its connection (``stage``: where the request was)."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


def error_response(
    status: int,
    message: str,
    kind: str,
    extra: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """``{"error": {"message", "type", **extra}}`` with ``status``."""
    body = {"error": {"message": message, "type": kind, **(extra or {})}}
    return web.json_response(body, status=status, headers=headers)


def decode_body(raw: bytes, kind: type[Any]) -> Any:
    """``raw`` decoded as ``kind``.

    Raises:
        ApiError: 400 for an empty body, invalid JSON or a field of the wrong type.
    """
    if not raw.strip():
        raise ApiError(400, "request body is empty: send a JSON object")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request body: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc


async def read_body(request: web.Request, limits: RequestLimits) -> bytes:
    """The request's body, within the limits.

    Raises:
        ApiError: 413 above ``max_body_bytes``, 408 past ``body_read_timeout_s``.
        ClientGone: The client closed its connection mid-body.
    """
    timeout_s = limits.body_read_timeout_s
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(
            413, f"request body exceeds the limit of {limits.max_body_bytes} bytes"
        ) from exc
    except asyncio.TimeoutError as exc:
        raise ApiError(
            408, f"request body not received within {timeout_s:g} s", "timeout", close=True
        ) from exc
    except ConnectionError as exc:  # the client closed mid-body
        raise ClientGone("body") from exc
