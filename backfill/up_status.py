"""What `backfill up` shows on its terminal: the batches' events, one line each, read from the
database once a second (the components' own logs go to files under BACKFILL_HOME/logs).

Only unfinished batches and the ones created in the last few seconds are read, so a poll costs
the same however many batches the database holds; a batch that starts and ends between two polls
still gets its lines.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import typer
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from backfill.api.wire import batch_id_out
from backfill.jobs.models import TERMINAL_STATUSES, Batch, BatchStatus, Team, utcnow

RECENT = timedelta(seconds=10)  # overlap between polls, for a batch created and finished in between
MAX_ERROR_CHARS = 120


@dataclass(frozen=True)
class BatchEvent:
    at: datetime
    batch_id: str
    what: str  # "created" or the status it moved to
    detail: str

    def line(self) -> str:
        return (
            f"{self.at.astimezone():%H:%M:%S}  {batch_id_out(self.batch_id)}  {self.what:<11}  {self.detail}".rstrip()
        )


def _detail(batch: Batch, team: str, status: str) -> str:
    counts = f"{batch.completed} ok, {batch.failed} failed of {batch.total}"
    if status == "created":
        return f"team {team}"
    if status == BatchStatus.in_progress:
        return f"{batch.total} lines, model {batch.model}"
    if status == BatchStatus.failed and batch.errors:
        message = str(batch.errors[0].get("message", ""))
        more = f" (+{len(batch.errors) - 1} more)" if len(batch.errors) > 1 else ""
        return message[:MAX_ERROR_CHARS] + more
    if status == BatchStatus.completed and batch.completed_at is not None:
        return f"{counts} in {(batch.completed_at - batch.created_at).total_seconds():.1f} s"
    return counts if batch.total else ""


class BatchEvents:
    """Remembers the status it last reported for each batch it still watches."""

    def __init__(self) -> None:
        self._reported: dict[str, str] = {}
        self._last_poll = utcnow()

    def poll(self, session: Session) -> list[BatchEvent]:
        now = utcnow()
        since = min(self._last_poll, now) - RECENT
        watching = [b for b, status in self._reported.items() if status not in TERMINAL_STATUSES]
        rows = session.execute(
            select(Batch, Team.name)
            .join(Team, Team.id == Batch.team_id)
            .where(
                or_(
                    Batch.status.not_in(list(TERMINAL_STATUSES)),
                    Batch.created_at >= since,
                    Batch.id.in_(watching),  # to see the status it ends in
                )
            )
            .order_by(Batch.created_at, Batch.id)
        ).all()
        events: list[BatchEvent] = []
        present = set()
        for batch, team in rows:
            present.add(batch.id)
            before = self._reported.get(batch.id)
            if before is None:
                events.append(BatchEvent(now, batch.id, "created", _detail(batch, team, "created")))
            if before != batch.status and batch.status != BatchStatus.validating:
                events.append(BatchEvent(now, batch.id, batch.status.value, _detail(batch, team, batch.status)))
            self._reported[batch.id] = batch.status
        # A finished batch that no longer shows up never changes again: stop watching it.
        for batch_id in [b for b, status in self._reported.items() if b not in present]:
            if self._reported[batch_id] in TERMINAL_STATUSES:
                del self._reported[batch_id]
        self._last_poll = now
        return events


def _models(base: str, key: str) -> str:
    try:
        r = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        ids = [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        ids = []
    return ", ".join(ids) or "(the fleet lists none yet)"


def banner(*, base: str, origin: str, key: str, fleet: str, home: Path, logs: Path) -> None:
    typer.secho("\nbackfill is up", fg=typer.colors.GREEN, bold=True)
    typer.echo(f"  base URL : {base}")
    typer.echo(f"  API key  : {key}")
    typer.echo(f"  model    : {_models(base, key)}")
    typer.echo(f"  fleet    : {fleet}")
    typer.echo(f"  metrics  : {origin}/metrics   ready: {origin}/ready")
    typer.echo(f"  state    : {home}   (logs in {logs})")
    typer.echo(
        f"  try      : OPENAI_BASE_URL={base} OPENAI_API_KEY={key} {sys.executable} -c"
        ' "import openai; print(openai.OpenAI().models.list())"'
    )
    typer.echo("Ctrl-C stops everything. Batch events:\n")
