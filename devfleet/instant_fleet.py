"""A fleet stand-in that answers at once: the cost of a batch line on backfill's side alone.

The simulated Dynamo fleet spends CPU of its own on every request (a frontend, a router, mocker
engines), on the same machine as the processes a control-plane benchmark measures. This one is
a raw asyncio HTTP/1.1 server in a thread: keep-alive, Content-Length bodies only, and a fixed
small chat completion (with usage) for every POST, so it costs a few tens of microseconds a
request and backfill's CPU, WAL and round trips per line stand out.

    with InstantFleet(model="tiny-chat") as fleet:   # backfill talks to fleet.base_url
        ...
    fleet.requests                                   # POSTs answered
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from types import TracebackType

import orjson

from .processes import LOOPBACK

MAX_HEAD_BYTES = 64 * 1024


class InstantFleet:
    """An OpenAI-compatible server that answers every chat completion at once, in a thread."""

    def __init__(self, *, model: str = "tiny-chat", completion: str = "ok", completion_tokens: int = 1) -> None:
        self.model = model
        self.completion = completion
        self.completion_tokens = completion_tokens
        self.requests = 0
        self.port = 0
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def origin(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    def __enter__(self) -> InstantFleet:
        self._thread = threading.Thread(target=self._serve, name="instant-fleet", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("instant fleet did not start")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._server = loop.run_until_complete(asyncio.start_server(self._handle, LOOPBACK, 0, backlog=1024))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                if len(head) > MAX_HEAD_BYTES:
                    return
                request_line, _, rest = head.partition(b"\r\n")
                method, _, target = request_line.partition(b" ")
                path = target.partition(b" ")[0].partition(b"?")[0]
                length = 0
                for header in rest.split(b"\r\n"):
                    name, _, value = header.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                body = await reader.readexactly(length) if length else b""
                status, payload = self._answer(method, path, body)
                writer.write(
                    b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"x-request-id: instant-%d\r\n\r\n%s"
                    % (status, b"OK" if status == 200 else b"Not Found", len(payload), next(self._ids), payload)
                )
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    def _answer(self, method: bytes, path: bytes, body: bytes) -> tuple[int, bytes]:
        if method == b"GET" and path == b"/health":
            return 200, b'{"status":"healthy"}'
        if method == b"GET" and path == b"/v1/models":
            return 200, orjson.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]})
        if method == b"POST" and path == b"/v1/chat/completions":
            self.requests += 1
            prompt_tokens = max(1, len(body) // 4)  # about a token per four bytes, as usage goes
            return 200, orjson.dumps(
                {
                    "id": f"chatcmpl-{self.requests}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": self.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": self.completion},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": self.completion_tokens,
                        "total_tokens": prompt_tokens + self.completion_tokens,
                    },
                }
            )
        return 404, b'{"error":{"message":"not found","type":"invalid_request_error"}}'
