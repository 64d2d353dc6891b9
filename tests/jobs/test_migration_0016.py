"""Migration 0016 on SQLite (the embedded mode) and Postgres: batches that were running when 0012
came in get their window's multiplier (they billed at 1x before), and retention's search for
batches to retire reads a partial index instead of every batch ever made."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Engine, select, text, update
from sqlalchemy.orm import Session

from backfill.devfleet.services import PG_ADMIN_URL, create_database, drop_database
from backfill.jobs.models import Batch, BatchStatus, Team, utcnow
from backfill.jobs.retention import batches_to_retire, ended_before
from backfill.migrate import alembic_config
from backfill.storage.db import make_engine
from tests.factories import make_batch


def _migrate(engine: Engine, action: str, revision: str) -> None:
    with engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        getattr(command, action)(cfg, revision)


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    name = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'm16.db'}"
    else:
        name = f"backfill_m16_{secrets.token_hex(4)}"
        url = create_database(PG_ADMIN_URL, name)
    engine = make_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()
        if name is not None:
            drop_database(PG_ADMIN_URL, name)


def test_running_batches_from_before_0012_get_their_windows_multiplier(engine: Engine) -> None:
    _migrate(engine, "upgrade", "head")  # (a Postgres scratch database is made at head)
    _migrate(engine, "downgrade", "0015")
    made: dict[str, tuple[BatchStatus, str, Decimal | None]] = {
        "running-1h": (BatchStatus.in_progress, "1h", None),
        "finalizing-72h": (BatchStatus.finalizing, "72h", None),
        "done-1h": (BatchStatus.completed, "1h", None),  # billed already: left as it was
        "quoted-1h": (BatchStatus.in_progress, "1h", Decimal("3")),  # created after 0012
        "odd-window": (BatchStatus.in_progress, "90m", None),  # no multiplier configured: 1x
    }
    ids: dict[str, str] = {}
    with Session(engine) as s, s.begin():
        team = Team(name="m16")
        s.add(team)
        s.flush()
        for label, (status, window, multiplier) in made.items():
            batch = make_batch(s, team, lines=0, status=status)
            batch.completion_window, batch.price_multiplier = window, multiplier
            ids[label] = batch.id
    _migrate(engine, "upgrade", "0016")
    with Session(engine) as s:
        got = {i: m for i, m in s.execute(select(Batch.id, Batch.price_multiplier))}
    assert {label: got[i] for label, i in ids.items()} == {
        "running-1h": Decimal("2.0"),
        "finalizing-72h": Decimal("0.8"),
        "done-1h": None,
        "quoted-1h": Decimal("3"),
        "odd-window": None,
    }


def test_the_search_for_batches_to_retire_reads_the_partial_index(engine: Engine) -> None:
    _migrate(engine, "upgrade", "head")
    with Session(engine) as s, s.begin():
        team = Team(name="m16-retire")
        s.add(team)
        s.flush()
        for _ in range(20):
            make_batch(s, team, lines=0, status=BatchStatus.completed)
        s.execute(update(Batch).values(completed_at=utcnow() - timedelta(hours=2)))
    with Session(engine) as s:
        if engine.dialect.name == "postgresql":
            s.execute(text("SET enable_seqscan = off"))  # a table this small would be read whole
        query = batches_to_retire_query(s)
        explain = "EXPLAIN QUERY PLAN " if engine.dialect.name == "sqlite" else "EXPLAIN "
        plan = " ".join(str(row) for row in s.execute(text(explain + query)))
        assert "ix_batches_unretired" in plan, plan
        assert len(batches_to_retire(s, ended=ended_before(utcnow()), limit=50)) == 20


def batches_to_retire_query(s: Session) -> str:
    """The statement `batches_to_retire` runs, with its values inlined (for EXPLAIN)."""
    captured: list[str] = []
    from sqlalchemy import event

    bind = s.get_bind()

    def grab(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "FROM batches" in statement and not captured:
            captured.append(context.compiled.statement.compile(bind, compile_kwargs={"literal_binds": True}).string)

    event.listen(bind, "before_cursor_execute", grab)
    try:
        batches_to_retire(s, ended=ended_before(utcnow()), limit=50)
    finally:
        event.remove(bind, "before_cursor_execute", grab)
    return captured[0]
