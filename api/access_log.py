"""The API's access log and request metrics, as a pure ASGI middleware.

One line per HTTP request on the stdlib logger `backfill.access`: method, route template (the
matched route's path with its `{placeholders}`, so ids stay out of it), status, latency, and the
team id when the request authenticated. Never a key, a header, a query string or a body: the
authentication dependency leaves the team id in the request's state (`scope["state"]`), which
is all this reads. The same fields, minus the team, feed `backfill_http_requests_total` and
`backfill_http_request_duration_seconds`.

Installed outermost, so it sees every answer: rate-limited, too large, failed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backfill.storage.metrics import counter, histogram

log = logging.getLogger("backfill.access")

UNMATCHED = "unmatched"  # no route: the path itself stays out of the metric labels
MAX_PATH_CHARS = 200
TEAM_STATE_KEY = "team_id"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(frozen=True)
class HttpMetrics:
    requests: Counter
    duration: Histogram


@lru_cache
def http_metrics() -> HttpMetrics:
    return HttpMetrics(
        requests=counter(
            "backfill_http_requests",
            "API requests answered, by route template and status.",
            ("method", "route", "status"),
        ),
        duration=histogram(
            "backfill_http_request_duration_seconds",
            "API request latency, to the end of the response body.",
            DURATION_BUCKETS,
            ("method", "route"),
        ),
    )


def route_template(scope: Scope) -> str | None:
    """The path template of the route that answered (FastAPI puts the route in the scope)."""
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else None


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the server answers if the app raises before starting a response

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self._record(scope, status, time.perf_counter() - started)

    @staticmethod
    def _record(scope: Scope, status: int, seconds: float) -> None:
        method = str(scope.get("method", ""))
        method = method if method in METHODS else "OTHER"  # a label value must come from a small set
        route = route_template(scope)
        state = scope.get("state")
        team = state.get(TEAM_STATE_KEY) if isinstance(state, dict) else None
        fields = {
            "method": method,
            "route": route or UNMATCHED,
            "status": status,
            "duration_ms": round(seconds * 1000, 1),
            "team_id": team,
        }
        if route is None:
            fields["path"] = str(scope.get("path", ""))[:MAX_PATH_CHARS]
        log.info(
            "%s %s %d %.1fms team=%s",
            method,
            route or fields.get("path"),
            status,
            fields["duration_ms"],
            team or "-",
            extra={"access": fields},
        )
        try:
            m = http_metrics()
            m.requests.labels(method=method, route=route or UNMATCHED, status=str(status)).inc()
            m.duration.labels(method=method, route=route or UNMATCHED).observe(seconds)
        except Exception:  # a metric must never fail the request it measures
            log.warning("could not record request metrics", exc_info=True)
