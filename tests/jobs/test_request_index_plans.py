"""The request index stays cheap to write and to read at a million lines: a pending line enters
no partial index, and the queries that look for running or served lines use those indexes
(their predicates written as SQL literals, which a generic plan can still prove), never a scan
of every line. Checked with EXPLAIN on Postgres, after the statistics a long run leaves."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import select, text, update
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs import sweeps
from backfill.jobs.execution.claims import _served_since
from backfill.jobs.models import RUNNING_LINES, BatchRequest, RequestState, utcnow
from tests.factories import make_batch, make_team

LINES = 20_000


def _index_entries(s: Session, name: str) -> int:
    """Live tuples the index points at (pageinspect is not needed: a bitmap count through it)."""
    return int(s.execute(text("SELECT pg_relation_size(:n)"), {"n": name}).scalar_one())


def _plan(s: Session, query: Any) -> str:
    """The generic plan (the one a statement prepared by the driver ends up with), as JSON."""
    compiled = query.compile(s.get_bind())
    names = re.findall(r"%\((\w+)\)s", compiled.string)
    sql = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}", compiled.string)
    raw = s.connection().connection.driver_connection
    assert raw is not None
    with psycopg.ClientCursor(raw) as cur:
        cur.execute("DEALLOCATE ALL")
        cur.execute(f"PREPARE probe AS {sql}")
        cur.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        args = ", ".join(["%s"] * len(names))
        cur.execute(
            f"EXPLAIN (FORMAT JSON) EXECUTE probe({args})" if names else "EXPLAIN (FORMAT JSON) EXECUTE probe",
            [compiled.params[n] for n in names],
        )
        row = cur.fetchone()
    assert row is not None
    return json.dumps(row[0])


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_partial_indexes_hold_no_pending_line_and_serve_their_queries(db: sessionmaker[Session]) -> None:
    with db.begin() as s:
        team = make_team(s, "plans")
        batch_id = make_batch(s, team, lines=LINES).id
        s.execute(update(BatchRequest).where(BatchRequest.batch_id == batch_id).values(prefix_hash="p"))
    with db.begin() as s:
        s.execute(text("ANALYZE batch_requests"))
        # Every line pending: both partial indexes are empty (one metapage, one root page at most).
        assert _index_entries(s, "ix_batch_requests_running") <= 16384
        assert _index_entries(s, "ix_batch_requests_served") <= 16384
        assert _index_entries(s, "ix_batch_requests_rank") > 100_000
    with db.begin() as s:
        s.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.line <= 20)
            .values(state=RequestState.running, claim_token="t", claimed_at=utcnow() - timedelta(hours=1))
        )
        s.execute(text("ANALYZE batch_requests"))
    with db.begin() as s:
        tokens = select(BatchRequest.claim_token).where(RUNNING_LINES).distinct()
        assert "ix_batch_requests_running" in _plan(s, tokens)
        held = select(BatchRequest.batch_id, BatchRequest.line).where(RUNNING_LINES, BatchRequest.claim_token == "t")
        assert "ix_batch_requests_running" in _plan(s, held)
    with db() as s:
        assert sweeps.running_claim_tokens(s) == ["t"]
        assert sweeps.lines_held_by(s, "t") == {batch_id: list(range(1, 21))}
        assert _served_since(s, batch_id=batch_id, prefixes={"p", "q"}, now=utcnow()) == {"p"}


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_a_bound_state_parameter_would_miss_the_partial_index(db: sessionmaker[Session]) -> None:
    """Why the literals: the same query with the state as a parameter cannot use the index
    under a generic plan (this is what the test above guards against)."""
    with db.begin() as s:
        team = make_team(s, "plans-bound")
        make_batch(s, team, lines=LINES)
        s.execute(text("ANALYZE batch_requests"))
    with db.begin() as s:
        bound = select(BatchRequest.claim_token).where(BatchRequest.state == RequestState.running).distinct()
        assert "ix_batch_requests_running" not in _plan(s, bound)
