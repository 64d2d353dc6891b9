"""App factory. Process wiring (which queue validation goes to) is passed in, so `api`
never imports the scheduler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from api.errors import install_error_handlers
from api.limits import BodyLimit
from api.routes import admin, batches, files, models, usage
from jobs.teams import ensure_key
from storage.db import unit_of_work
from storage.settings import get_settings


def install_configured_keys() -> None:
    settings = get_settings()
    with unit_of_work() as session:
        if settings.bootstrap_api_key:
            ensure_key(session, team_name="default", raw_key=settings.bootstrap_api_key)
        if settings.admin_api_key:
            ensure_key(session, team_name="admin", raw_key=settings.admin_api_key, is_admin=True)


def create_app(*, enqueue_validation: Callable[[str], None] | None = None) -> FastAPI:
    get_settings().check_production()
    app = FastAPI(title="backfill", version="0.1.0", docs_url="/docs", redoc_url=None)
    app.state.enqueue_validation = enqueue_validation
    install_error_handlers(app)
    app.add_middleware(BodyLimit)
    for module in (files, batches, models, usage, admin):
        app.include_router(module.router)

    @app.get("/health", include_in_schema=False)
    def health() -> dict[str, Any]:
        return {"status": "ok"}

    return app
