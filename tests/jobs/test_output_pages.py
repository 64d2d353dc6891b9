"""Pages of finished lines are cut by bytes, not by line count: a batch of large answers
(embeddings run to hundreds of KB a line) is read a bounded number of bytes at a time, on
SQLite and Postgres. A page of 5,000 such lines used to be read (and, on Postgres, built as one
string) at once: past 1 GB the database refused it, below that it cost the worker gigabytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.models import BatchStatus, RequestState
from backfill.jobs.output import pages as output_pages
from backfill.jobs.output.finalize import finalize_batch, output_key
from backfill.jobs.output.format import ERROR_STATES, OUTPUT_STATES, error_bodies, format_lines
from backfill.jobs.output.pages import pages
from backfill.storage.objects import LocalObjectStore
from tests.factories import formatter_rows
from tests.jobs.test_output import _batch, _files, _statements, answered_line

MiB = 1024 * 1024
PAGE_LIMIT = 16 * MiB  # what a page may hold at most, unless it is one line larger than that
BIG_LINE = 30  # its answer alone is over the limit: a page of its own


def _large_batch(db: sessionmaker[Session]) -> tuple[str, str]:
    """40 answered lines of about 1 MiB each (one in ten failed), one of 17 MiB."""
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states={})
        for line in range(1, 41):
            size = 17 * MiB if line == BIG_LINE else MiB
            failed = line % 10 == 0
            s.add(
                answered_line(
                    batch.id,
                    line,
                    failed=failed,
                    body={"embedding": f"{line:x}" * (size // len(f"{line:x}"))},
                    prompt_tokens=line,
                )
            )
            s.flush()
        return batch.id, batch.team_id


def test_pages_are_cut_by_bytes_and_a_line_over_the_budget_is_a_page_of_its_own(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    batch_id, team_id = _large_batch(db)
    with db() as s:
        read = list(pages(db.begin, batch_id, (OUTPUT_STATES, ERROR_STATES), pending_as=RequestState.expired))
        rows = formatter_rows(s, batch_id)
    sizes = [(sum(len(x) for x in p.lines), sum(p.counts)) for p in read]
    assert len(read) >= 40 * MiB // PAGE_LIMIT + 1, sizes
    for size, count in sizes:
        assert size <= PAGE_LIMIT or count == 1, sizes
    assert [count for size, count in sizes if size > 17 * MiB] == [1]  # the big line, alone
    # Cut anywhere, the pages are the bytes of all the rows formatted at once, in order.
    errors = error_bodies(RequestState.expired)
    for n, states in enumerate((OUTPUT_STATES, ERROR_STATES)):
        assert b"".join(p.lines[n] for p in read) == format_lines((r for r in rows if r.state in states), errors)

    store = LocalObjectStore(tmp_path / "objects")
    assert finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.completed
    written = _files(store, team_id, batch_id)
    assert len(written[output_key(team_id, batch_id, "output")].splitlines()) == 36
    assert len(written[output_key(team_id, batch_id, "error")].splitlines()) == 4


def test_a_range_with_a_line_too_large_to_read_whole_is_cut_and_so_are_the_ranges_after_it(
    db: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Postgres a range of ROWS_PER_FETCH lines is read as one page by one statement unless a
    line of it is larger than PAGE_BYTES / ROWS_PER_FETCH: that statement formats no such line
    and says so, and only then are the range's sizes read and its pages cut, and, the batch's
    answers being large, the sizes of the ranges read after it. On either database: the bytes
    of one formatting of all the rows, in order, no page past its bound but a line of its own."""
    monkeypatch.setattr(output_pages, "ROWS_PER_FETCH", 10)
    monkeypatch.setattr(output_pages, "PAGE_BYTES", 64 * 1024)  # a line of up to 6.4 KB: a range is a page
    large = range(26, 31)  # 20 KB answers: the range (20, 30] is cut
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states={})
        for line in range(1, 61):
            s.add(
                answered_line(
                    batch.id,
                    line,
                    failed=not line % 7,
                    body={"t": "y" * (20_000 if line in large else 300)},
                    prompt_tokens=line,
                )
            )
        s.flush()
        batch_id = batch.id
    postgres = db.kw["bind"].dialect.name == "postgresql"
    seen = _statements(db, monkeypatch)
    read = list(pages(db.begin, batch_id, (OUTPUT_STATES, ERROR_STATES), pending_as=RequestState.expired))
    with db() as s:
        rows = formatter_rows(s, batch_id)
    errors = error_bodies(RequestState.expired)
    for n, states in enumerate((OUTPUT_STATES, ERROR_STATES)):
        assert b"".join(p.lines[n] for p in read) == format_lines((r for r in rows if r.state in states), errors)
    assert sum(sum(p.counts) for p in read) == 60
    assert sum(p.usage[0] for p in read) == sum(line for line in range(1, 61) if line % 7)
    for p in read:
        assert sum(len(x) for x in p.lines) <= 64 * 1024 or sum(p.counts) == 1
    if postgres:
        cut = {start for sql, start in seen if "string_agg" not in sql and "octet_length" in sql}
        assert {0, 10}.isdisjoint(cut) and 20 in cut, cut  # read whole, then cut by their sizes
        assert 50 in cut, cut  # asked for after the cut: cut before it is read
        assert len(read) > 6  # (20, 30]: more than one page


def test_a_page_is_read_by_the_primary_keys_range_scan_in_line_order(db: sessionmaker[Session]) -> None:
    """On Postgres a page's statement is planned as the primary key's range scan: the lines come
    in line order with no sort, and no parallel workers are started for it. Here the planner,
    left alone, reads the range by a bitmap scan and sorts it (two batches' lines interleaved, as
    in a table of many batches: `line` correlates with nothing), and planned for the range's
    values it splits that between two parallel workers."""
    if db.kw["bind"].dialect.name != "postgresql":
        pytest.skip("Postgres plans")
    with db.begin() as s:
        batches = [_batch(s, status=BatchStatus.finalizing, states={}) for _ in range(2)]
        s.execute(
            text(
                'INSERT INTO batch_requests (batch_id, line, custom_id, "offset", length, prefix_hash, token_estimate,'
                " state, attempts, prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens)"
                " SELECT b, i, 'r' || i, 0, 1, '', 0, 'pending', 0, 0, 0, 0, 0"
                " FROM generate_series(1, 20000) AS i, unnest(CAST(:ids AS text[])) AS b"
            ),
            {"ids": [b.id for b in batches]},
        )
    with db() as s:
        s.connection().exec_driver_sql("ANALYZE batch_requests")
        s.commit()
    files = (OUTPUT_STATES, ERROR_STATES)
    statement = output_pages._pg_page_sql(
        output_pages._file_of_states(files), tuple(str(state) for state in error_bodies(RequestState.expired))
    )
    params = {
        **output_pages._pg_params(batches[0].id, RequestState.expired),
        "start": 5000,
        "end": 10000,
        "line_cap": 1677,
    }
    with db.begin() as s:
        connection = s.connection().connection.driver_connection
        assert connection is not None
        with connection.cursor() as cursor:
            cursor.execute(output_pages._PG_RANGE_SCAN)
            plan = "\n".join(row[0] for row in cursor.execute("EXPLAIN " + statement, params))
    assert "Index Scan using batch_requests_pkey" in plan, plan
    assert "Sort" not in plan and "Gather" not in plan and "Bitmap" not in plan, plan
