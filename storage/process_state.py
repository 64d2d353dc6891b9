"""The process's shared adapters, and the one way to drop them.

Each process builds its adapters lazily from the settings, once: the settings themselves
(`get_settings`), the database engine and session factory, the object store, the fleet's model
catalog, the lease store and the broker's Celery app. A process that changes its environment
afterwards (a test, a tool pointing at another database) calls `reset()`, and the next reader
builds each again from the new settings. Nothing else clears these caches by hand.
"""

from __future__ import annotations

from backfill.storage import broker, db, fleet_models, leases, objects, settings


def reset() -> None:
    """Drop every cached adapter (closing the engine's and the broker's pooled connections first)."""
    if db.get_engine.cache_info().currsize:
        db.get_engine().dispose()
    if broker.get_celery_app.cache_info().currsize:
        broker.get_celery_app().close()
    for cached in (
        settings.get_settings,
        db.get_engine,
        db._session_factory,
        objects.get_object_store,
        broker.get_celery_app,
    ):
        cached.cache_clear()
    fleet_models._catalog = None
    leases._store = None
