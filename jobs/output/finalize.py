"""Finalization: output.jsonl and error.jsonl in OpenAI's line format, then the terminal status.

Three short units of work, so no row lock is held while bytes move:
1. in_progress -> finalizing by compare-and-set once no line is left to run, committed at once
   (`jobs.output.finalize.begin`);
2. the files, both streamed from one read-only pass over the rows (`jobs.output.pages`) into the
   object store at once (`storage.objects`);
3. a compare-and-set to the terminal status that, when it wins, creates the File rows
   (`jobs.output.finalize.complete`).

Once a batch is finalizing (or cancelling with nothing running) its lines no longer change, and
object keys and file ids derive from the batch id, so a finalization redone after a crash (or
run twice at once) rewrites the same bytes at the same keys; only the step-3 winner writes rows.

A cancel that arrives while the files are written answers at once: a `finalizing` batch is past
cancelling, so `cancel_batch` refuses it with a conflict (as before) and the batch completes; a
batch that was already `cancelling` stays so and ends `cancelled`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from contextlib import closing
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import Exists, case, exists, select, update
from sqlalchemy.orm import Session

from backfill.jobs.models import Batch, BatchRequest, BatchStatus, File, RequestState, utcnow
from backfill.jobs.output.format import ERROR_STATES, OUTPUT_STATES
from backfill.jobs.output.pages import Page, pages
from backfill.jobs.sweeps import has_running
from backfill.jobs.webhooks.events import record_batch_event
from backfill.storage.db import UnitOfWork
from backfill.storage.objects import ObjectStore, uploads

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


# Finalization's two status changes, each a compare-and-set committed on its own (`jobs.output.finalize`):
#
# - `begin`: in_progress -> finalizing once no line is left to run, and the plan of what to write;
# - `complete`: finalizing (or cancelling) -> the terminal status, with the counters, the usage and,
#   for the winner only, the File rows of the files written.
#
# Object keys and file ids derive from the batch id, so a finalization redone after a crash (or run
# twice at once) names the same files; only the compare-and-set's winner writes rows.


def derived_file_id(batch_id: str, kind: str) -> str:
    return hashlib.blake2b(f"{batch_id}:{kind}".encode(), digest_size=12).hexdigest()


def output_key(team_id: str, batch_id: str, kind: str) -> str:
    return f"batches/{team_id}/{batch_id}/{kind}.jsonl"


@dataclass(frozen=True)
class Plan:
    batch_id: str
    team_id: str
    status: BatchStatus  # finalizing or cancelling: what `complete` compares against
    expired: bool
    output_expires_after_s: int | None

    @property
    def pending_as(self) -> RequestState:
        """What a line still pending is written as: the batch was cancelled, or it expired (a
        finalizing batch that did not expire has no pending line)."""
        return RequestState.cancelled if self.status == BatchStatus.cancelling else RequestState.expired


@dataclass
class Written:
    succeeded: int = 0
    errored: int = 0
    usage: tuple[int, int, int, int] = (0, 0, 0, 0)
    sizes: dict[str, int] = field(default_factory=dict)  # kind -> bytes, for the files written

    def add(self, page: Page) -> None:
        self.succeeded += page.counts[0]
        self.errored += page.counts[1]
        self.usage = (
            self.usage[0] + page.usage[0],
            self.usage[1] + page.usage[1],
            self.usage[2] + page.usage[2],
            self.usage[3] + page.usage[3],
        )


def _unfinished(batch_id: str) -> Exists:
    return exists().where(
        BatchRequest.batch_id == batch_id,
        BatchRequest.state.in_([RequestState.pending, RequestState.running]),
    )


def begin(session: Session, batch_id: str) -> Plan | BatchStatus | None:
    """The plan of a batch ready to be written, else its status (None for an unknown batch)."""
    batch = session.get(Batch, batch_id)
    if batch is None:
        return None
    if batch.status == BatchStatus.in_progress:
        session.execute(
            update(Batch)
            .where(
                Batch.id == batch_id,
                Batch.status == BatchStatus.in_progress,
                Batch.unindexed == 0,
                ~_unfinished(batch_id),
            )
            .values(status=BatchStatus.finalizing, finalizing_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        session.refresh(batch)
    if batch.status not in (BatchStatus.finalizing, BatchStatus.cancelling):
        return batch.status
    if batch.unindexed or has_running(session, batch_id):
        # Lines still to be written by validation (`write_index_parts`), or a cancelling batch
        # still draining its running lines.
        return batch.status
    return Plan(
        batch_id=batch_id,
        team_id=batch.team_id,
        status=batch.status,
        expired=batch.expired_at is not None,
        output_expires_after_s=batch.output_expires_after_s,
    )


def complete(session: Session, plan: Plan, written: Written) -> BatchStatus | None:
    """The terminal status, if this finalization wins the compare-and-set; else the batch's status."""
    now = utcnow()
    stamp: str | None
    if plan.status == BatchStatus.cancelling:
        terminal, stamp = BatchStatus.cancelled, "cancelled_at"
    elif plan.expired:
        terminal, stamp = BatchStatus.expired, None  # expired_at was set when the window closed
    else:
        terminal, stamp = BatchStatus.completed, "completed_at"
    file_ids = {kind: derived_file_id(plan.batch_id, kind) for kind in written.sizes}
    values: dict[str, Any] = {
        "status": terminal,
        "output_file_id": file_ids.get("output"),
        "error_file_id": file_ids.get("error"),
        "completed": written.succeeded,
        "failed": written.errored,
        "input_tokens": written.usage[0],
        "cached_tokens": written.usage[1],
        "output_tokens": written.usage[2],
        "reasoning_tokens": written.usage[3],
        "finalizing_at": case((Batch.finalizing_at.is_(None), now), else_=Batch.finalizing_at),
    }
    if stamp:
        values[stamp] = now
    won = session.execute(
        update(Batch)
        .where(Batch.id == plan.batch_id, Batch.status == plan.status)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if won.rowcount == 0:  # type: ignore[attr-defined]
        # Another finalization got there first (its rows name the same files), or the batch is gone.
        return session.execute(select(Batch.status).where(Batch.id == plan.batch_id)).scalar()
    record_batch_event(session, batch_id=plan.batch_id, status=terminal)  # the webhook outbox, same transaction
    expires = now + timedelta(seconds=plan.output_expires_after_s) if plan.output_expires_after_s else None
    for kind, size in written.sizes.items():
        session.merge(
            File(
                id=file_ids[kind],
                team_id=plan.team_id,
                purpose="batch_output",
                filename=f"batch_{plan.batch_id}_{kind}.jsonl",
                bytes=size,
                object_key=output_key(plan.team_id, plan.batch_id, kind),
                created_at=now,
                expires_at=expires,
            )
        )
    session.flush()
    return terminal
