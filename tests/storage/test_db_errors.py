"""`storage.db.is_transient`: which database errors the same work may get past by trying again."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from backfill.devfleet.processes import free_port
from backfill.storage.db import is_transient, make_engine


def _raised(url: str, *statements: str) -> SQLAlchemyError:
    engine = make_engine(url)
    try:
        with pytest.raises(SQLAlchemyError) as err, engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
        return err.value
    finally:
        engine.dispose()


def test_an_unreachable_database_is_transient() -> None:
    exc = _raised(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nothing", "SELECT 1")
    assert is_transient(exc), repr(exc)


def test_a_refused_statement_is_not() -> None:
    dup = _raised(
        "sqlite://",
        "CREATE TABLE t (id INTEGER PRIMARY KEY)",
        "INSERT INTO t VALUES (1)",
        "INSERT INTO t VALUES (1)",
    )
    assert not is_transient(dup), repr(dup)
    assert not is_transient(ValueError("not a database error"))
