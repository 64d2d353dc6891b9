"""Alembic environment: one linear history for Postgres and SQLite."""

from __future__ import annotations

from alembic import context

# Each import registers its tables on Base.metadata.
import backfill.jobs.billing.models
import backfill.jobs.models
import backfill.jobs.webhooks.models
import backfill.storage.leases  # noqa: F401
from backfill.storage.db import Base, get_engine

target_metadata = Base.metadata


def run_migrations_online() -> None:
    connectable = context.config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    with get_engine().connect() as connection:
        _run(connection)


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # An index built over a large table may take longer than a service's statement bound.
            connection.exec_driver_sql("SET LOCAL statement_timeout = 0")
        context.run_migrations()


run_migrations_online()
