"""Database engine and unit of work. Postgres in production, SQLite when embedded."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from backfill.storage.settings import get_settings


class Base(DeclarativeBase):
    pass


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            # WAL lets the API read while a worker writes; the busy timeout serialises writers.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def is_transient(exc: BaseException) -> bool:
    """The database could not be reached or dropped the connection (or a deadlock): the same
    work may succeed if tried again. Anything else is the database refusing the work itself."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


@lru_cache
def get_engine() -> Engine:
    settings = get_settings()
    if settings.embedded:
        settings.home.mkdir(parents=True, exist_ok=True)
    return make_engine(settings.resolved_database_url)


@lru_cache
def _session_factory() -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(), expire_on_commit=False)


@contextmanager
def unit_of_work() -> Iterator[Session]:
    """One transaction: services flush, this boundary commits (or rolls back on error)."""
    session = _session_factory()()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
