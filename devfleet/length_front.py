"""A small HTTP front before the simulated fleet's Dynamo frontend that gives a request without
a length limit the model's default one, as a real engine does.

OpenAI does not require `max_tokens`; vLLM and SGLang default it to what the context leaves
after the prompt. The Dynamo mocker instead answers 400 "`max_output_tokens` (or `max_tokens`)
is required by the mocker worker", and neither it nor the frontend has a setting for a default
(DYN_MAX_OUTPUT_TOKENS and --max-model-len were tried: still 400). So the simulated fleet fills
the limit here: the context left after the prompt, capped by the model's default
(`DEFAULT_MAX_TOKENS`, since the mocker always generates the whole limit). The prompt's size is
bounded by its body's bytes (a token covers at least one byte), so the fill never overruns the
context. Everything else (a body with a limit, GETs, /metrics, streams) passes through as it
came. Only the simulated fleet has this front: backfill sends bodies to real fleets untouched.

It runs in a thread of the process that owns the fleet, so it lives and dies with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .processes import LOOPBACK, free_port

DEFAULT_MAX_TOKENS = 256  # the simulated model's default limit on the tokens it generates
CONTEXT_TOKENS = 32768  # the tiny model's max_position_embeddings (devfleet.model)
# Each endpoint's limit fields, the first is the one filled; any present and not null is a limit.
LIMIT_FIELDS = {
    "/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/completions": ("max_tokens",),
    "/responses": ("max_output_tokens",),
}
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host", "content-length"})


def with_default_limit(path: str, raw: bytes, *, default: int, context: int) -> bytes:
    """`raw` with the endpoint's limit filled in when it has none; otherwise `raw` itself."""
    fields = next((f for suffix, f in LIMIT_FIELDS.items() if path.endswith(suffix)), None)
    if fields is None:
        return raw
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw  # the engine answers a malformed body itself
    if not isinstance(body, dict) or any(body.get(f) is not None for f in fields):
        return raw
    body[fields[0]] = max(1, min(default, context - len(raw)))
    return orjson.dumps(body)


class LengthFront:
    """Listens on `port` and forwards to `upstream` (an origin, http://host:port)."""

    def __init__(
        self,
        upstream: str,
        *,
        port: int | None = None,
        default: int = DEFAULT_MAX_TOKENS,
        context: int = CONTEXT_TOKENS,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = port or free_port()
        self.default, self.context = default, context
        self._client: httpx.AsyncClient | None = None
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST", "PUT", "DELETE"])])
        config = uvicorn.Config(
            app, host=LOOPBACK, port=self.port, log_level="warning", access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="length-front", daemon=True)

    @property
    def origin(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> LengthFront:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the length front did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    async def _forward(self, request: Request) -> Response:
        if self._client is None:  # made on the server's own loop
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None))
        raw = await request.body()
        if request.method == "POST":
            raw = with_default_limit(request.url.path, raw, default=self.default, context=self.context)
        headers: dict[str, Any] = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        url = self.upstream + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream = await self._client.send(
            self._client.build_request(request.method, url, content=raw, headers=headers), stream=True
        )

        async def body() -> AsyncIterator[bytes]:
            async for chunk in upstream.aiter_raw():
                yield chunk

        return StreamingResponse(
            body(),
            status_code=upstream.status_code,
            headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP},
            background=BackgroundTask(upstream.aclose),
        )
