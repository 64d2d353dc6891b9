"""App factory. `create_app()` builds the app and touches nothing; start-up work (refusing
development secrets outside development, installing the configured keys) runs in its lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError

from backfill.api.access_log import AccessLog
from backfill.api.errors import install_error_handlers
from backfill.api.limits import BodyLimit, UploadGate
from backfill.api.ratelimit import RateLimit
from backfill.api.routes import (
    admin,
    batches,
    dashboard,
    files,
    forecast,
    models,
    ops,
    partial,
    uploads,
    usage,
    webhooks,
)
from backfill.jobs.teams import ensure_key
from backfill.storage.db import unit_of_work
from backfill.storage.settings import get_settings


def install_configured_keys(tries: int = 3) -> None:
    """Idempotent; API processes starting side by side (replicas, hosts) may race to create the
    same team or key: the loser's insert fails on the unique key, and a second pass finds theirs."""
    settings = get_settings()
    for left in range(tries - 1, -1, -1):
        try:
            with unit_of_work() as session:  # an unset variable revokes the key it configured before
                ensure_key(session, team_name="default", raw_key=settings.bootstrap_api_key)
                ensure_key(session, team_name="admin", raw_key=settings.admin_api_key, is_admin=True)
            return
        except IntegrityError:
            if not left:
                raise


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    get_settings().check_production()
    await run_in_threadpool(install_configured_keys)
    yield


class Health(BaseModel):
    status: str


def create_app() -> FastAPI:
    app = FastAPI(title="backfill", version="0.1.0", docs_url="/docs", redoc_url=None, lifespan=lifespan)
    install_error_handlers(app)
    # The last added runs first: the rate limit, then the upload gate, then the body cap.
    app.add_middleware(BodyLimit)
    app.add_middleware(UploadGate)
    app.add_middleware(RateLimit)
    app.add_middleware(AccessLog)  # outermost: it logs every answer, a 429 or 413 too
    for module in (files, uploads, batches, models, usage, admin, partial, forecast, webhooks, dashboard, ops):
        app.include_router(module.router)
    app.include_router(dashboard.page)  # the page and its two assets: not API routes

    @app.get("/health", include_in_schema=False)
    def health() -> Health:
        return Health(status="ok")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _without_422(
                get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _without_422(document: dict[str, Any]) -> dict[str, Any]:
    """FastAPI documents a 422 for every route with parameters; this app never sends one (a bad
    request gets a 400 in the error envelope, declared on every router), so drop it."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return document
