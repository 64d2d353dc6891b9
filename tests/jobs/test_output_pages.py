"""Pages of finished lines are cut by bytes, not by line count: a batch of large answers
(embeddings run to hundreds of KB a line) is read a bounded number of bytes at a time, on
SQLite and Postgres. A page of 5,000 such lines used to be read (and, on Postgres, built as one
string) at once: past 1 GB the database refused it, below that it cost the worker gigabytes."""

from __future__ import annotations

from pathlib import Path

import orjson
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.models import BatchRequest, BatchStatus, RequestState
from backfill.jobs.output.finalize import finalize_batch, output_key
from backfill.jobs.output.format import ERROR_STATES, OUTPUT_STATES, error_bodies, format_lines
from backfill.jobs.output.pages import pages
from backfill.storage.objects import LocalObjectStore
from tests.jobs.test_output import _batch, _files

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
                BatchRequest(
                    batch_id=batch.id,
                    line=line,
                    custom_id=f"req-{line}",
                    offset=0,
                    length=1,
                    state=RequestState.failed if failed else RequestState.succeeded,
                    result_id=f"r{line}",
                    status_code=400 if failed else 200,
                    request_id=f"fleet-{line}",
                    response_body=orjson.dumps({"embedding": f"{line:x}" * (size // len(f"{line:x}"))}).decode(),
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
        rows = s.execute(
            select(
                BatchRequest.line,
                BatchRequest.result_id,
                BatchRequest.custom_id,
                BatchRequest.state,
                BatchRequest.status_code,
                BatchRequest.request_id,
                BatchRequest.response_body,
            )
            .where(BatchRequest.batch_id == batch_id)
            .order_by(BatchRequest.line)
        ).all()
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
