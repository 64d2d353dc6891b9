"""The process's shared adapters, and the one way to drop them.

Each process builds its adapters lazily from the settings, once: the settings themselves
(`get_settings`), the database engine and session factory, the object store, the fleet's model
catalog and the lease store. A process that changes its environment afterwards (a test, a tool
pointing at another database) calls `reset()`, and the next reader builds each again from the new
settings. Nothing else clears these caches by hand.
"""

from __future__ import annotations

from backfill.storage import db, fleet_models, leases, objects, settings


def reset() -> None:
    """Drop every cached adapter (closing the engine's pooled connections first)."""
    if db.get_engine.cache_info().currsize:
        db.get_engine().dispose()
    for cached in (settings.get_settings, db.get_engine, db._session_factory, objects.get_object_store):
        cached.cache_clear()
    fleet_models._catalog = None
    leases._store = None
