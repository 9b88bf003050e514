"""A blocking POST of raw bytes to a loopback HTTP server (the HTTP fuzz tests)."""

from __future__ import annotations

import http.client
import json
from typing import Any

REPLY_TIMEOUT_S = 60.0
"""How long a server may take to answer (a hang fails the test)."""


def post(
    port: int, path: str, body: bytes, content_type: str = "application/json"
) -> tuple[int, Any]:
    """POST raw bytes to ``127.0.0.1:port``; returns the status and the parsed JSON body
    (or its text when it is not JSON)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REPLY_TIMEOUT_S)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw.decode(errors="replace")
