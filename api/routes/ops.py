"""For operators: `/metrics` (Prometheus) and `/ready` (can this API do its work). `/health` stays
the liveness probe: it answers while the process runs, whatever its dependencies do.

`/metrics` adds up what every backfill process wrote to the shared metrics directory (drains,
the capacity controller, the ledger, the API's own requests: `storage.metrics`) and reads a few
numbers from the database at scrape time: batches by status and the lines of unfinished
batches by state (grouped counts on the batches' counters, no scan of lines), with the SLO the
capacity controller protects beside them.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Iterator
from typing import Literal

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel
from sqlalchemy.exc import SQLAlchemyError

from backfill.api.routes.dashboard import pool_loads
from backfill.jobs.metrics import batches_by_status, lines_by_state
from backfill.jobs.models import BatchStatus, RequestState
from backfill.storage.db import unit_of_work
from backfill.storage.metrics import scrape_registry
from backfill.storage.readiness import CHECKS, NotConfigured
from backfill.storage.settings import Settings, get_settings

log = logging.getLogger("backfill.api.ops")
router = APIRouter(tags=["operations"])

READY_TIMEOUT_S = 3.0
MAX_ERROR_CHARS = 300


class DatabaseGauges(Collector):
    """Scrape-time numbers: a collector the scrape's registry calls once."""

    def collect(self) -> Iterator[Metric]:
        s = get_settings()
        up = GaugeMetricFamily("backfill_metrics_database_up", "Whether this scrape could read the database.")
        try:
            with unit_of_work() as session:
                batches, lines = batches_by_status(session), lines_by_state(session)
        except SQLAlchemyError:
            log.warning("metrics: the database could not be read", exc_info=True)
            up.add_metric([], 0)
        else:
            up.add_metric([], 1)
            by_status = GaugeMetricFamily("backfill_batches", "Batches by status.", labels=["status"])
            for status in BatchStatus:
                by_status.add_metric([status.value], batches.get(status.value, 0))
            yield by_status
            by_state = GaugeMetricFamily(
                "backfill_lines", "Lines of the unfinished batches, by state.", labels=["state"]
            )
            for state in (RequestState.pending, RequestState.running, RequestState.succeeded, RequestState.failed):
                by_state.add_metric([state.value], lines.get(state.value, 0))
            yield by_state
        yield up
        yield GaugeMetricFamily(
            "backfill_slo_ttft_seconds", "The interactive time-to-first-token SLO.", value=s.slo_ttft_s
        )
        yield GaugeMetricFamily(
            "backfill_slo_itl_seconds", "The interactive inter-token latency SLO.", value=s.slo_itl_s
        )
        yield GaugeMetricFamily(
            "backfill_capacity_control_enabled",
            "1 when the capacity controller sets the lease limit, 0 for the fixed bound.",
            value=int(s.capacity_controlled),
        )
        yield GaugeMetricFamily(
            "backfill_fixed_inflight_limit",
            "The configured bound on batch requests in flight (the controller's ceiling unless set).",
            value=s.max_inflight,
        )
        yield from _pool_gauges(s)


def _pool_gauges(s: Settings) -> Iterator[Metric]:
    """Capacity per lease pool (`api.routes.dashboard.pool_loads`): a deployment's, or one model's."""
    labels = ["pool", "model", "deployment"]
    held = GaugeMetricFamily(
        "backfill_capacity_pool_leases_held", "Capacity leases held, by lease pool.", labels=labels
    )
    limit = GaugeMetricFamily(
        "backfill_capacity_pool_limit", "The lease limit released to batch work, by lease pool.", labels=labels
    )
    inflight = GaugeMetricFamily(
        "backfill_capacity_pool_fleet_inflight",
        "Requests (every kind) in flight at the pool's frontend: its model's, for a model's pool.",
        labels=labels,
    )
    try:
        pools = pool_loads(s)
    except Exception:  # a scrape answers with what it has
        log.warning("metrics: the capacity pools could not be read", exc_info=True)
        return
    for p in pools:
        values = [p.pool, p.model or "", p.deployment]
        for family, value in ((held, p.batch_inflight), (limit, p.limit), (inflight, p.fleet_inflight)):
            if value is not None:
                family.add_metric(values, value)
    yield from (held, limit, inflight)


def _authorized(request: Request) -> bool:
    token = get_settings().metrics_token
    if not token:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


# Not in the OpenAPI document: its body is Prometheus's text format, not JSON.
@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    if not _authorized(request):
        return Response("metrics need the bearer token BACKFILL_METRICS_TOKEN\n", status_code=401)
    body = generate_latest(scrape_registry(DatabaseGauges()))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


class Check(BaseModel):
    status: Literal["ok", "failed", "not_configured"]
    duration_ms: float
    error: str | None = None


class Readiness(BaseModel):
    status: Literal["ready", "not_ready"]
    failed: list[str]
    checks: dict[str, Check]


async def _run(check: Callable[[], None]) -> Check:
    started = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.to_thread(check), READY_TIMEOUT_S)
    except NotConfigured as exc:
        return Check(status="not_configured", duration_ms=_ms(started), error=str(exc))
    except TimeoutError:
        return Check(status="failed", duration_ms=_ms(started), error=f"no answer within {READY_TIMEOUT_S:.0f} s")
    except Exception as exc:  # noqa: BLE001 -- any failure of a dependency is the answer, not an error
        message = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return Check(status="failed", duration_ms=_ms(started), error=message[:MAX_ERROR_CHARS])
    return Check(status="ok", duration_ms=_ms(started))


def _is_admin(request: Request) -> bool:
    """Whether the caller sent the configured admin key (BACKFILL_ADMIN_API_KEY), compared in
    constant time. Never a database lookup: /ready is exempt from the rate limits, so a lookup
    per probe would let anyone spend the keys table, and with the database down each lookup's
    thread would outlive the probe's timeout."""
    configured = get_settings().admin_api_key
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if not configured or scheme.lower() != "bearer" or not token:
        return False
    return hmac.compare_digest(token.encode(), configured.encode())


def _ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)


@router.get(
    "/ready",
    responses={503: {"model": Readiness, "description": "A dependency failed: `failed` names which."}},
)
async def ready(request: Request, response: Response) -> Readiness:
    """Readiness: the database, the broker, Redis (when configured) and the object store, each
    checked with one round trip, side by side; 503 naming what failed. Why it failed (errors
    that name hosts, users, paths) is told to the configured admin key
    (BACKFILL_ADMIN_API_KEY) only, never to a key looked up in the database."""
    results = await asyncio.gather(*(_run(check) for check in CHECKS.values()))
    if not _is_admin(request):
        results = [check.model_copy(update={"error": None}) for check in results]
    checks = dict(zip(CHECKS, results, strict=True))
    failed = [name for name, check in checks.items() if check.status == "failed"]
    if failed:
        response.status_code = 503
    return Readiness(status="not_ready" if failed else "ready", failed=failed, checks=checks)
