"""What the fault tests measure with.

- `SendCounter`: a pass-through proxy between backfill and the fleet that counts what backfill
  sent, per line (by the line's prompt), and how many requests it had in flight at once; a
  client that hangs up is passed on to the fleet, so an aborted request is aborted there too.
- `FleetInflight`: samples the fleet frontend's own in-flight gauge
  (`dynamo_frontend_inflight_requests`) in a thread.
- `FaultReport`: every fault scenario records what it measured (a `FaultRecord`, with the
  scheduler replicas that ran and the leader terms begun meanwhile); after the run
  the suite prints a table and, as its very last line,
  `faults: scenarios=N lost=L duplicated=D double_billed=B stuck=S max_over_limit=K`.
  A count is summed over the scenarios that measured it; max_over_limit is the most requests
  the fleet had in flight above the published limit (`na` when no scenario could read it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson


@dataclass
class FaultRecord:
    name: str
    requests: int
    lost: int
    duplicated: int
    double_billed: int
    stuck: int
    over_cap: int  # lines sent more times than the attempt cap
    max_over_limit: int | None
    fleet_peak: int | None  # the most requests the fleet's gauge showed in flight
    limit: int
    resumed_s: float | None  # fault cleared -> the first line finishes again
    terminal_s: float | None  # fault cleared -> every batch terminal
    did: str = ""
    schedulers: int = 0  # scheduler replicas running when it ended (a leader and a standby: 2)
    leader_terms: int = 0  # leader terms begun during it (0: the leader it began with led throughout)


@dataclass
class FaultReport:
    records: list[FaultRecord] = field(default_factory=list)

    def record(self, rec: FaultRecord) -> None:
        self.records.append(rec)

    def summary_line(self) -> str:
        over = [r.max_over_limit for r in self.records if r.max_over_limit is not None]
        return (
            f"faults: scenarios={len(self.records)} lost={sum(r.lost for r in self.records)} "
            f"duplicated={sum(r.duplicated for r in self.records)} "
            f"double_billed={sum(r.double_billed for r in self.records)} "
            f"stuck={sum(r.stuck for r in self.records)} "
            f"max_over_limit={max(over) if over else 'na'}"
        )

    def table(self) -> list[str]:
        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        rows = [
            "| fault | requests | lost | duplicated | over cap | over limit | resumed (s) | all terminal (s) "
            "| schedulers (new leader terms) | what the service did |"
        ]
        rows.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in self.records:
            rows.append(
                f"| {r.name} | {r.requests} | {r.lost} | {r.duplicated} | {r.over_cap} | "
                f"{'na' if r.max_over_limit is None else f'{r.max_over_limit} (peak {r.fleet_peak}/{r.limit})'} | "
                f"{s(r.resumed_s)} | {s(r.terminal_s)} | {r.schedulers} ({r.leader_terms}) | {r.did} |"
            )
        return rows


def prompt_of(body: bytes) -> str:
    """The first message's text: the fault tests make it unique per line."""
    try:
        messages = orjson.loads(body).get("messages") or [{}]
        return str(messages[0].get("content", ""))
    except (orjson.JSONDecodeError, AttributeError, IndexError):
        return ""


class SendCounter:
    """A pass-through proxy that counts sends per line and requests in flight."""

    def __init__(self, upstream_origin: str, port: int) -> None:
        self.upstream = upstream_origin.rstrip("/")
        self.port = port
        self.sends: Counter[str] = Counter()
        self.log: list[tuple[float, str, str]] = []  # (time, prompt, what happened)
        self.inflight = 0
        self.max_inflight = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def window(self) -> None:
        """Start a new measurement window for the in-flight maximum."""
        self.max_inflight = self.inflight

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(600, connect=10), limits=httpx.Limits(max_connections=1024)
            )
        counted = scope["method"] == "POST"
        t0 = time.time()
        if counted:
            self.sends[prompt_of(body)] += 1
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            url = (
                self.upstream
                + scope["path"]
                + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
            )
            headers = {
                k.decode(): v.decode() for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")
            }
            upstream = asyncio.ensure_future(self._client.request(scope["method"], url, content=body, headers=headers))

            async def hung_up() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass

            gone = asyncio.ensure_future(hung_up())
            done, _ = await asyncio.wait({upstream, gone}, return_when=asyncio.FIRST_COMPLETED)
            if upstream not in done:
                upstream.cancel()  # the client hung up: so does the fleet's client
                self.log.append((time.time(), prompt_of(body), f"client hung up {scope.get('client')}"))
                return
            self.log.append((time.time(), prompt_of(body), f"answered {scope.get('client')} {time.time() - t0:.3f}"))
            gone.cancel()
            try:
                resp = upstream.result()
                status, content = resp.status_code, resp.content
                out = [(b"content-type", resp.headers.get("content-type", "application/json").encode())]
                if "x-request-id" in resp.headers:
                    out.append((b"x-request-id", resp.headers["x-request-id"].encode()))
            except httpx.HTTPError as exc:
                status, content, out = 502, orjson.dumps({"error": {"message": repr(exc)}}), []
            await send({"type": "http.response.start", "status": status, "headers": out})
            await send({"type": "http.response.body", "body": content})
        finally:
            if counted:
                self.inflight -= 1

    def start(self) -> SendCounter:
        import uvicorn

        config = uvicorn.Config(self, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="send-counter", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the send counter did not start"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


class FleetInflight:
    """The fleet frontend's in-flight gauge, sampled every `every_s` in a thread."""

    METRIC = "dynamo_frontend_inflight_requests"

    def __init__(self, metrics_url: str, every_s: float = 0.1) -> None:
        self.url = metrics_url
        self.every_s = every_s
        self.max_seen: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-inflight", daemon=True)

    def read(self) -> int | None:
        try:
            text = httpx.get(self.url, timeout=1.0).text
        except httpx.HTTPError:
            return None
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(self.METRIC) and line[len(self.METRIC) : len(self.METRIC) + 1] in ("{", " ")
        ]
        return int(sum(values)) if values else None

    def window(self) -> None:
        self.max_seen = None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            n = self.read()
            if n is not None:
                self.samples += 1
                self.max_seen = n if self.max_seen is None else max(self.max_seen, n)

    def __enter__(self) -> FleetInflight:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
