"""Database engine and unit of work. Postgres in production, SQLite when embedded."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from backfill.storage.settings import get_settings


class Base(DeclarativeBase):
    pass


@dataclass(frozen=True)
class DbBounds:
    """How long a Postgres connection may wait on anything: without these a tick or a drain
    blocked on a dead TCP connection or a lock waits for ever (and a scheduler keeps its lease)."""

    connect_timeout_s: float = 10.0
    statement_timeout_s: float = 300.0
    lock_timeout_s: float = 30.0
    # A peer gone without a FIN is noticed in idle + interval x count seconds (~1 min); while
    # data sits unacknowledged, tcp_user_timeout ends the connection instead.
    keepalives_idle_s: int = 30
    keepalives_interval_s: int = 10
    keepalives_count: int = 3

    def connect_args(self) -> dict[str, Any]:
        options = [
            f"-c statement_timeout={int(self.statement_timeout_s * 1000)}",
            f"-c lock_timeout={int(self.lock_timeout_s * 1000)}",
        ]
        return {
            "connect_timeout": max(2, int(self.connect_timeout_s)),  # (libpq's least)
            "keepalives": 1,
            "keepalives_idle": self.keepalives_idle_s,
            "keepalives_interval": self.keepalives_interval_s,
            "keepalives_count": self.keepalives_count,
            "tcp_user_timeout": (self.keepalives_idle_s + self.keepalives_interval_s * self.keepalives_count) * 1000,
            "options": " ".join(options),
        }


def db_bounds() -> DbBounds:
    s = get_settings()
    return DbBounds(
        connect_timeout_s=s.db_connect_timeout_s,
        statement_timeout_s=s.db_statement_timeout_s,
        lock_timeout_s=s.db_lock_timeout_s,
    )


def make_engine(url: str, bounds: DbBounds | None = None) -> Engine:
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
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=10,
        max_overflow=20,
        connect_args=(bounds or db_bounds()).connect_args(),
    )


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


# What a function that opens its own short transactions takes: `unit_of_work`, or a test's own.
UnitOfWork = Callable[[], AbstractContextManager[Session]]


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
