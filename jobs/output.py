"""Finalization: output.jsonl and error.jsonl in OpenAI's line format, then the terminal status.

Three short units of work, so no row lock is held while bytes move:
1. in_progress -> finalizing by compare-and-set once no line is left to run, committed at once
   (`jobs.finalize_status.begin`);
2. the files, both streamed from one read-only pass over the rows (`jobs.output_pages`) into the
   object store at once (`storage.upload_pipe`);
3. a compare-and-set to the terminal status that, when it wins, creates the File rows
   (`jobs.finalize_status.complete`).

Once a batch is finalizing (or cancelling with nothing running) its lines no longer change, and
object keys and file ids derive from the batch id, so a finalization redone after a crash (or
run twice at once) rewrites the same bytes at the same keys; only the step-3 winner writes rows.

A cancel that arrives while the files are written answers at once: a `finalizing` batch is past
cancelling, so `cancel_batch` refuses it with a conflict (as before) and the batch completes; a
batch that was already `cancelling` stays so and ends `cancelled`.
"""

from __future__ import annotations

import logging
import time
from contextlib import closing

from backfill.jobs.finalize_status import Plan, Written, begin, complete, derived_file_id, output_key
from backfill.jobs.models import BatchStatus
from backfill.jobs.output_format import ERROR_STATES, OUTPUT_STATES
from backfill.jobs.output_pages import UnitOfWork, pages
from backfill.storage.objects import ObjectStore
from backfill.storage.upload_pipe import uploads

__all__ = ["UnitOfWork", "derived_file_id", "finalize_batch", "output_key"]

log = logging.getLogger("backfill.finalization")

_KINDS = ("output", "error")


def _write_files(units: UnitOfWork, store: ObjectStore, plan: Plan) -> Written:
    """Read-only: the lines of a finalizing batch are settled, so no lock is taken or needed,
    and each page is read in a short transaction of its own.

    One read of the rows: each page gives both files' lines (put concurrently, `uploads`) and
    the counts and usage, which only succeeded lines carry."""
    written = Written()
    read = pages(units, plan.batch_id, (OUTPUT_STATES, ERROR_STATES), pending_as=plan.pending_as)
    keys = [output_key(plan.team_id, plan.batch_id, kind) for kind in _KINDS]
    with closing(read), uploads(store, keys, thread_name_prefix="finalize-put") as puts:
        for page in read:
            for put, lines in zip(puts, page.lines, strict=True):
                put.send(lines)
            written.add(page)
    for kind, put in zip(_KINDS, puts, strict=True):
        if (size := put.size()) is not None:
            written.sizes[kind] = size
    return written


def finalize_batch(units: UnitOfWork, store: ObjectStore, *, batch_id: str) -> BatchStatus | None:
    """Write the result files, then move the batch to its terminal status. Idempotent.

    `units` opens one committed transaction per call (`storage.db.unit_of_work`, or a
    sessionmaker's `begin`). Returns the batch's status afterwards, None for an unknown batch.
    """
    started = time.monotonic()
    with units() as session:
        plan = begin(session, batch_id)
    if not isinstance(plan, Plan):
        return plan
    planned = time.monotonic()
    written = _write_files(units, store, plan)
    wrote = time.monotonic()
    with units() as session:
        status = complete(session, plan, written)
    ended = time.monotonic()
    log.info(
        "finalized batch %s: %s, %d lines, %.1f MB in %.2f s (begin %.2f s, files %.2f s, status %.2f s)",
        batch_id,
        status,
        written.succeeded + written.errored,
        sum(written.sizes.values()) / 1e6,
        ended - started,
        planned - started,
        wrote - planned,
        ended - wrote,
    )
    return status
