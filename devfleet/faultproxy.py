"""A fault-injecting HTTP reverse proxy to put between backfill and a fleet frontend.

Runs its own asyncio loop in a thread of the test process and is steered with plain method
calls from the test:

    with FaultProxy(fleet.origin) as proxy:          # backfill talks to proxy.base_url
        proxy.inject(Fault.error, for_s=3)           # 5xx answers for 3 s
        proxy.inject(Fault.reset, count=10)          # the next 10 requests: connection reset

Faults (by default only on POST: telemetry and model listing pass through untouched):
- error: answer at once with a 5xx (503 unless told), the fleet never sees the request;
- timeout: read the request and never answer (the client's timeout has to end it);
- reset: read the request, then reset the connection (TCP RST), the fleet never sees it;
- stall: forward to the fleet, send the reply's headers and half its body, then stall;
- pretty: forward to the fleet and give its JSON reply back pretty-printed, with a trailing
  newline (as some engines and proxies write it).

Rules apply in the order given; a request takes the first active one. Counters in `stats`
tell a test how many requests met each fault, so a test can show its faults really happened.

Given several upstreams it is also a small round-robin load balancer (one address in front of
several API processes, as on two hosts): each request goes to the next upstream in turn, and one
that refuses the connection is skipped for the next (`stats["failed_over"]`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import h11
import httpx

from .processes import LOOPBACK

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"host"})
MAX_REQUEST_BYTES = 16 * 1024 * 1024


class Fault(StrEnum):
    error = "error"
    timeout = "timeout"
    reset = "reset"
    stall = "stall"
    pretty = "pretty"


@dataclass
class _Rule:
    fault: Fault
    remaining: int | None  # requests left to hit; None: any number until `until`
    until: float | None  # time.monotonic() deadline; None: until `remaining` runs out
    status: int

    def active(self, now: float) -> bool:
        return (self.remaining is None or self.remaining > 0) and (self.until is None or now < self.until)


class FaultProxy:
    def __init__(
        self,
        upstream: str | Sequence[str],
        *,
        host: str = LOOPBACK,
        port: int = 0,
        methods: Iterable[str] = ("POST",),
    ) -> None:
        self.upstreams = [u.rstrip("/") for u in ([upstream] if isinstance(upstream, str) else upstream)]
        if not self.upstreams:
            raise ValueError("no upstream")
        self.upstream = self.upstreams[0]
        self._turn = itertools.count()
        self.host = host
        self.port = port
        self.methods = frozenset(m.upper() for m in methods)
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._stats: Counter[str] = Counter()
        self._models: Counter[str] = Counter()  # requests per model named in their body
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._client: httpx.AsyncClient | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # -- control, from any thread -------------------------------------------------------

    @property
    def origin(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    def inject(self, fault: Fault, *, count: int | None = None, for_s: float | None = None, status: int = 503) -> None:
        """Apply `fault` to the next `count` requests, or to every request for `for_s` seconds."""
        if (count is None) == (for_s is None):
            raise ValueError("give exactly one of count= or for_s=")
        until = time.monotonic() + for_s if for_s is not None else None
        with self._lock:
            self._rules.append(_Rule(fault, count, until, status))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    @property
    def stats(self) -> dict[str, int]:
        """Requests seen per outcome: one key per fault; `forwarded` (requests that could meet a
        fault, passed on unharmed), `passed` (other methods), `upstream_failed`."""
        with self._lock:
            return dict(self._stats)

    @property
    def by_model(self) -> dict[str, int]:
        """Requests seen per `model` their JSON body names (what reached this deployment,
        whatever its outcome)."""
        with self._lock:
            return dict(self._models)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> FaultProxy:
        loop = asyncio.new_event_loop()
        opened = asyncio.run_coroutine_threadsafe(self._open(), loop)
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=f"faultproxy:{self.upstream}", daemon=True)
        self._thread.start()
        opened.result(timeout=10)
        return self

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._loop = self._thread = None

    # -- the proxy, on its own loop -----------------------------------------------------

    async def _open(self) -> None:
        self._client = httpx.AsyncClient(
            trust_env=False,  # loopback only: never through an http_proxy from the environment
            timeout=httpx.Timeout(600.0, connect=5.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # held (timeout, stall) connections end with the proxy
        if self._server is not None:
            await self._server.wait_closed()
        if self._client is not None:
            await self._client.aclose()

    def _take(self, method: str) -> _Rule | None:
        if method not in self.methods:
            return None
        now = time.monotonic()
        with self._lock:
            self._rules = [r for r in self._rules if r.active(now)]
            for rule in self._rules:
                if rule.remaining is not None:
                    rule.remaining -= 1
                return rule
        return None

    def _count(self, what: str) -> None:
        with self._lock:
            self._stats[what] += 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        try:
            while True:
                request = await self._read_request(conn, reader)
                if request is None:
                    return
                head, body = request
                method = head.method.decode()
                model = _model_of(body)
                if model is not None:
                    with self._lock:
                        self._models[model] += 1
                rule = self._take(method)
                if rule is not None:
                    self._count(rule.fault.value)
                if rule is None or rule.fault in (Fault.stall, Fault.pretty):
                    label = "forwarded" if method in self.methods else "passed"
                    fault = rule.fault if rule is not None else None
                    outcome = await self._forward(conn, writer, head, body, fault=fault, label=label)
                    if outcome == "stalled":
                        await self._hold(reader)
                        return
                elif rule.fault is Fault.error:
                    await self._answer(conn, writer, rule.status, b'{"error":{"message":"injected fault"}}')
                elif rule.fault is Fault.timeout:
                    await self._hold(reader)
                    return
                else:
                    self._reset(writer)
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _read_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader
    ) -> tuple[h11.Request, bytes] | None:
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_REQUEST_BYTES:
                    raise h11.LocalProtocolError("request body too large for the fault proxy")
            elif isinstance(event, h11.EndOfMessage) and head is not None:
                return head, bytes(body)
            else:  # ConnectionClosed, or PAUSED after a close
                return None

    async def _forward(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        head: h11.Request,
        body: bytes,
        *,
        fault: Fault | None,
        label: str,
    ) -> str:
        """Pass the request to the fleet and its reply back: "forwarded"; with `Fault.stall` only
        half the reply's body goes back: "stalled" (the connection is to be held); with
        `Fault.pretty` a JSON body goes back pretty-printed; "upstream_failed".
        A full reply is counted under `label`."""
        assert self._client is not None
        headers = [(k, v) for k, v in head.headers if k.lower() not in HOP_BY_HOP and k.lower() != b"content-length"]
        first = next(self._turn)
        try:
            for k in range(len(self.upstreams)):
                upstream = self.upstreams[(first + k) % len(self.upstreams)]
                request = self._client.build_request(
                    head.method.decode(), upstream + head.target.decode(), headers=headers, content=body
                )
                try:
                    resp = await self._client.send(request, stream=True)
                    break
                except httpx.ConnectError:
                    if k == len(self.upstreams) - 1:
                        raise
                    self._count("failed_over")  # nothing reached that one: the next may take it
        except httpx.HTTPError as exc:
            self._count("upstream_failed")
            message = f'{{"error":{{"message":"fault proxy: upstream {type(exc).__name__}"}}}}'
            await self._answer(conn, writer, 502, message.encode())
            return "upstream_failed"
        try:
            out = [(k, v) for k, v in resp.headers.raw if k.lower() not in HOP_BY_HOP]
            if fault is not None:
                raw = await resp.aread()
                if fault is Fault.pretty:  # (read decoded: any content-encoding goes too)
                    raw = _pretty(raw)
                    out = [(k, v) for k, v in out if k.lower() not in (b"content-length", b"content-encoding")]
                    out.append((b"content-length", str(len(raw)).encode()))
                    self._count(label)
                    await self._answer(conn, writer, resp.status_code, raw, headers=out)
                    return "forwarded"
                out = [(k, v) for k, v in out if k.lower() != b"content-length"]
                out.append((b"content-length", str(len(raw)).encode()))
                writer.write(conn.send(h11.Response(status_code=resp.status_code, headers=out)) or b"")
                writer.write(conn.send(h11.Data(data=raw[: len(raw) // 2])) or b"")
                await writer.drain()
                return "stalled"
            self._count(label)  # before any byte goes out: a client holding its reply finds it counted
            writer.write(conn.send(h11.Response(status_code=resp.status_code, headers=out)) or b"")
            async for chunk in resp.aiter_raw():
                writer.write(conn.send(h11.Data(data=chunk)) or b"")
                await writer.drain()
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
            return "forwarded"
        finally:
            await resp.aclose()

    async def _answer(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        *,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        if headers is None:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        writer.write(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
        writer.write(conn.send(h11.Data(data=body)) or b"")
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()

    @staticmethod
    async def _hold(reader: asyncio.StreamReader) -> None:
        """Keep the connection open and silent until the client (or the proxy's stop) ends it."""
        while await reader.read(65536):
            pass

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # Linger on with a zero timeout: close() sends RST instead of FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()


def _model_of(body: bytes) -> str | None:
    """The `model` a JSON request body names, if any."""
    if not body.startswith(b"{"):
        return None
    try:
        model = json.loads(body).get("model")
    except ValueError:
        return None
    return model if isinstance(model, str) else None


def _pretty(raw: bytes) -> bytes:
    """A JSON body indented over several lines and ended by a newline; anything else as it is."""
    try:
        return json.dumps(json.loads(raw), indent=2).encode() + b"\n"
    except ValueError:
        return raw
