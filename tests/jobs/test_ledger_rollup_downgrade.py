"""Downgrading past migration 0011 drops `usage_ledger.requests`: a rolled-up ledger row (a
negative line standing for many) would then read as one request. The downgrade refuses while
such rows exist, and goes through when none do. On SQLite (the embedded mode) and Postgres."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Engine, inspect
from sqlalchemy.orm import Session

from backfill.devfleet.services import PG_ADMIN_URL, create_database, drop_database
from backfill.jobs.billing.models import UsageLedgerEntry
from backfill.migrate import alembic_config
from backfill.storage.db import make_engine
from tests.factories import make_batch, make_team


def _migrate(engine: Engine, action: str, revision: str) -> None:
    with engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        getattr(command, action)(cfg, revision)


def _ledger_row(engine: Engine, *, line: int, requests: int) -> None:
    with Session(engine) as s, s.begin():
        team = make_team(s, "t")
        batch = make_batch(s, team, lines=0)
        s.add(UsageLedgerEntry(batch_id=batch.id, line=line, team_id=team.id, model="m", requests=requests))


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    name = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
    else:
        name = f"backfill_downgrade_{secrets.token_hex(4)}"
        url = create_database(PG_ADMIN_URL, name)
    engine = make_engine(url)
    try:
        _migrate(engine, "upgrade", "head")
        yield engine
    finally:
        engine.dispose()
        if name is not None:
            drop_database(PG_ADMIN_URL, name)


def test_the_downgrade_refuses_while_rolled_up_rows_exist(engine: Engine) -> None:
    _ledger_row(engine, line=-1, requests=40)
    with pytest.raises(RuntimeError, match="rolled up"):
        _migrate(engine, "downgrade", "0010")
    assert "requests" in {c["name"] for c in inspect(engine).get_columns("usage_ledger")}  # nothing dropped


def test_the_downgrade_goes_through_with_only_per_line_rows(engine: Engine) -> None:
    _ledger_row(engine, line=1, requests=1)
    _migrate(engine, "downgrade", "0010")
    assert "requests" not in {c["name"] for c in inspect(engine).get_columns("usage_ledger")}
