"""The web dashboard: a static page (`/dashboard`, plain HTML + one small script, no build step)
and the two JSON routes it reads besides the existing batches, usage and costs routes.

The page asks for an API key, keeps it in sessionStorage and sends it as a Bearer token: a team
key shows that team's batches, an admin key every team's. The fleet view samples
`GET /v1/dashboard/fleet` every few seconds and plots the fleet's in-flight requests (from the
frontend's Prometheus metrics), the batch requests in flight (capacity leases held) and the
released lease limit over time, summed over the lease pools, and shows each pool beside: a
deployment's, or one model's on a deployment serving several (`scheduler.fleet.routing`).

The lease gauges are the lease store's own reads (`storage.leases`: a pool's count, the limit
the controller published), by the names it gives pools and values.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import redis
from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.exc import SQLAlchemyError

from backfill.api.deps import CurrentPrincipal, DbSession
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.protocol import DashboardBatch, DashboardBatches, DashboardTeam, FleetLoad, PoolLoad
from backfill.api.wire import batch_id_out, project_id_out, ts
from backfill.jobs import batches as batch_service
from backfill.jobs import teams as team_service
from backfill.storage.fleet_models import get_catalog
from backfill.storage.leases import LeaseStore, get_lease_store, pool_name, released_limit
from backfill.storage.settings import Settings, get_settings

ASSETS = Path(__file__).resolve().parent.parent / "dashboard"
# The only files served, with their types: nothing a path can reach beyond these.
_ASSET_TYPES = {"app.js": "text/javascript", "style.css": "text/css"}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

INFLIGHT_METRIC = "dynamo_frontend_inflight_requests"
SCRAPE_TIMEOUT_S = 1.0
SAMPLE_CACHE_S = 1.0  # many open dashboards cost the fleet one scrape a second
BATCHES_SHOWN = 50

page = APIRouter(include_in_schema=False)
router = APIRouter(prefix="/v1/dashboard", tags=["dashboard"], responses=error_responses(*COMMON_ERRORS))


@page.get("/dashboard")
def dashboard_page() -> Response:
    return Response((ASSETS / "index.html").read_bytes(), media_type="text/html", headers=_PAGE_HEADERS)


@page.get("/dashboard/{asset}")
def dashboard_asset(asset: str) -> Response:
    media_type = _ASSET_TYPES.get(asset)
    if media_type is None:
        return Response(status_code=404)
    return Response((ASSETS / asset).read_bytes(), media_type=media_type, headers=_PAGE_HEADERS)


# -- Batches ------------------------------------------------------------------------------------


@router.get("/batches")
def dashboard_batches(principal: CurrentPrincipal, session: DbSession) -> DashboardBatches:
    """The most recent batches: the caller's team's, or every team's for an admin key."""
    scope = None if principal.is_admin else principal.team_id
    rows, _ = batch_service.list_batches(session, team_id=scope, limit=BATCHES_SHOWN, after=None)
    teams = [t for t in team_service.list_teams(session) if scope is None or t.id == scope]
    return DashboardBatches(
        object="dashboard.batches",
        admin=principal.is_admin,
        project_id=project_id_out(principal.team_id),
        teams=[DashboardTeam(project_id=project_id_out(t.id), name=t.name) for t in teams],
        data=[
            DashboardBatch(
                id=batch_id_out(b.id),
                project_id=project_id_out(b.team_id),
                status=b.status,
                endpoint=b.endpoint,
                model=b.model,
                created_at=ts(b.created_at),
                expires_at=ts(b.expires_at),
                total=b.total,
                completed=b.completed,
                failed=b.failed,
                input_tokens=b.input_tokens,
                output_tokens=b.output_tokens,
            )
            for b in rows
        ],
    )


# -- Fleet load ---------------------------------------------------------------------------------


def lease_gauges(settings: Settings, store: LeaseStore, pool: str, fallback_pool: str | None = None) -> tuple[int, int]:
    """(leases held in the pool, the limit released to it now), as admission reads them."""
    limit = released_limit(
        store,
        pool,
        controlled=settings.capacity_controlled,
        fixed_limit=settings.max_inflight,
        floor=settings.capacity_floor,
        fallback_pool=fallback_pool,
    )
    return store.count(pool), limit


def pool_names(settings: Settings) -> list[tuple[int, str | None, str]]:
    """(deployment, model, pool name) of every lease pool of the fleet, as `scheduler.fleet.routing`
    names them: a deployment's plain pool, or a pool per model where it serves several."""
    out: list[tuple[int, str | None, str]] = []
    for d, url in enumerate(settings.fleet_urls):
        served = get_catalog().served_by(url)
        if served is None or len(served) < 2:
            out.append((d, None, pool_name(d)))
        else:
            out += [(d, m, pool_name(d, m)) for m in sorted(served)]
    return out


def pool_loads(settings: Settings) -> list[PoolLoad]:
    """Each pool's leases held and released limit (a model's pool without a controller of its
    own takes its deployment's), and its requests in flight at the frontend."""
    out = []
    store = get_lease_store()
    frontends = [next((ep.url for ep in eps if ep.role == "frontend"), None) for eps in settings.fleet_metrics]
    for d, model, pool in pool_names(settings):
        held: int | None
        limit: int | None
        try:
            held, limit = lease_gauges(settings, store, pool, pool_name(d) if model is not None else None)
        except (redis.RedisError, SQLAlchemyError, OSError):
            held = limit = None
        url = frontends[d] if d < len(frontends) else None
        out.append(
            PoolLoad(
                pool=pool,
                deployment=settings.fleet_urls[d],
                model=model,
                batch_inflight=held,
                limit=limit,
                fleet_inflight=fleet_inflight([url], model=model) if url else None,
            )
        )
    return out


def frontend_metrics_urls(settings: Settings) -> list[str]:
    """The fleet's frontends' metrics URLs, each once."""
    urls = [ep.url for deployment in settings.fleet_metrics for ep in deployment if ep.role == "frontend"]
    return list(dict.fromkeys(urls))


def _inflight_of(text: str, model: str | None = None) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == INFLIGHT_METRIC
        for sample in family.samples
        if sample.name == INFLIGHT_METRIC and (model is None or sample.labels.get("model") == model)
    )


def fleet_inflight(urls: list[str], *, model: str | None = None) -> int | None:
    """Requests in flight at the fleet's frontends (every kind; of `model` only, given one), None
    if a frontend is unreadable."""
    if not urls:
        return None
    total = 0.0
    try:
        with httpx.Client(timeout=SCRAPE_TIMEOUT_S) as client:
            for url in urls:
                response = client.get(url)
                response.raise_for_status()
                total += _inflight_of(response.text, model)
    except (httpx.HTTPError, ValueError):
        return None
    return int(total)


class _SampleCache:
    """The last sample, reused for SAMPLE_CACHE_S so dashboards never multiply the scrapes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sample: FleetLoad | None = None

    def get(self) -> FleetLoad:
        with self._lock:
            if self._sample is None or time.time() - self._sample.at >= SAMPLE_CACHE_S:
                self._sample = _sample(get_settings())
            return self._sample


def _sample(settings: Settings) -> FleetLoad:
    held: int | None
    limit: int | None
    try:
        held, limit = lease_gauges(settings, get_lease_store(), pool_name(0))
    except (redis.RedisError, SQLAlchemyError, OSError):
        held = limit = None  # the store is unreachable: the sample says so, the page shows a gap
    fleet = fleet_inflight(frontend_metrics_urls(settings))
    pools = pool_loads(settings)
    if len(pools) > 1 and all(p.batch_inflight is not None and p.limit is not None for p in pools):
        # Several pools (deployments, or models on one): the fleet's figures are their sums.
        held = sum(p.batch_inflight or 0 for p in pools)
        limit = sum(p.limit or 0 for p in pools)
    return FleetLoad(
        object="dashboard.fleet_load",
        at=time.time(),
        fleet_inflight=fleet,
        batch_inflight=held,
        interactive_inflight=max(0, fleet - held) if fleet is not None and held is not None else None,
        limit=limit,
        capacity_control=settings.capacity_controlled,
        pools=pools,
    )


_samples = _SampleCache()


@router.get("/fleet")
def dashboard_fleet(principal: CurrentPrincipal) -> FleetLoad:
    """The fleet's load now: all in-flight requests, the batch ones, and the released limit."""
    return _samples.get()
