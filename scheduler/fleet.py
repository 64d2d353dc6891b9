"""The fleet client: one pooled HTTP client over the fleet's OpenAI-compatible base URLs."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class FleetReply:
    status_code: int
    body: bytes
    request_id: str | None
    latency_s: float
    transient: bool  # worth retrying: overload, server error, timeout, connection failure


class FleetClient:
    def __init__(self, urls: list[str], *, timeout_s: float, api_key: str = "", max_connections: int = 1024) -> None:
        if not urls:
            raise ValueError("no fleet URL configured (BACKFILL_FLEET_URLS)")
        self._urls = urls
        self._next = itertools.cycle(range(len(urls)))
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def post(self, endpoint: str, body: dict[str, Any]) -> FleetReply:
        """POST a batch line's body to the same path on the fleet (`/v1/...` under a base URL)."""
        base = self._urls[next(self._next)]
        path = endpoint[len("/v1") :] if endpoint.startswith("/v1/") else endpoint
        started = time.monotonic()
        try:
            resp = await self._client.post(
                base + path, content=orjson.dumps(body), headers={"Content-Type": "application/json"}
            )
        except httpx.TimeoutException as exc:
            return self._synthetic(504, f"fleet timeout: {exc!r}", started)
        except httpx.TransportError as exc:
            return self._synthetic(503, f"fleet connection error: {exc!r}", started)
        return FleetReply(
            status_code=resp.status_code,
            body=resp.content,
            request_id=resp.headers.get("x-request-id"),
            latency_s=time.monotonic() - started,
            transient=resp.status_code in RETRYABLE_STATUS,
        )

    @staticmethod
    def _synthetic(status: int, message: str, started: float) -> FleetReply:
        body = orjson.dumps({"error": {"message": message, "type": "fleet_unreachable", "param": None, "code": None}})
        return FleetReply(status, body, None, time.monotonic() - started, transient=True)

    async def aclose(self) -> None:
        await self._client.aclose()
