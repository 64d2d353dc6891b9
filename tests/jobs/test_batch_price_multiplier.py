"""A batch is billed at the window multiplier in force when it was created: `create_batch` stores
BACKFILL_WINDOW_PRICE_MULTIPLIERS' value for its window on the batch, and every line is billed
from that, whatever the settings of the process that records it say later. SQLite and Postgres."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from decimal import Decimal

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.batches import create_batch
from backfill.jobs.billing.forecast import cost_so_far
from backfill.jobs.billing.ledger import Rates, set_price
from backfill.jobs.billing.models import UsageLedgerEntry
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcome
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, File
from backfill.storage.process_state import reset as reset_process_state
from backfill.storage.settings import get_settings
from tests.factories import make_team

WINDOWS = {"24h": 86400, "7d": 7 * 86400}
USAGE = Usage(1000, 0, 100, 0)  # 1000 input at $1/M + 100 output at $4/M, half off: 700 micros at 1x


@pytest.fixture
def set_multipliers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Change BACKFILL_WINDOW_PRICE_MULTIPLIERS for this process, as a redeploy (or a worker with
    other settings) would."""

    def change(value: str) -> None:
        monkeypatch.setenv("BACKFILL_WINDOW_PRICE_MULTIPLIERS", value)
        reset_process_state()

    yield change
    reset_process_state()


def _batch(s: Session, window: str, lines: int) -> str:
    team = make_team(s, "t")
    source = File(team_id=team.id, purpose="batch", filename="in.jsonl", bytes=1, object_key="k")
    s.add(source)
    s.flush()
    batch = create_batch(
        s,
        team_id=team.id,
        input_file_id=source.id,
        endpoint="/v1/chat/completions",
        completion_window=window,
        windows=WINDOWS,
        multipliers=get_settings().window_price_multipliers,
    )
    s.execute(  # what validation does, in short
        update(Batch)
        .where(Batch.id == batch.id)
        .values(status=BatchStatus.in_progress, model="m", total=lines)
        .execution_options(synchronize_session=False)
    )
    for line in range(1, lines + 1):
        s.add(BatchRequest(batch_id=batch.id, line=line, custom_id=f"r{line}", offset=0, length=1))
    return batch.id


def _record(db: sessionmaker[Session], batch_id: str, line: int) -> None:
    """One line, in a transaction (a recorder's group) of its own."""
    with db.begin() as s:
        token = f"c{line}"
        assert claim_requests(s, batch_id=batch_id, limit=1, claim_token=token)
        assert record_outcome(
            s, batch_id=batch_id, line=line, claim_token=token, outcome=Outcome(200, b"{}", "r", USAGE)
        )


def _costs(db: sessionmaker[Session], batch_id: str) -> list[int]:
    with db() as s:
        query = select(UsageLedgerEntry.cost_micros).where(UsageLedgerEntry.batch_id == batch_id)
        return list(s.execute(query.order_by(UsageLedgerEntry.line)).scalars())


def test_a_multiplier_changed_between_two_lines_bills_both_at_the_creation_multiplier(
    db: sessionmaker[Session], set_multipliers: Callable[[str], None]
) -> None:
    set_multipliers("7d=0.6")
    with db.begin() as s:
        set_price(s, model="m", input_micros=1_000_000, cached_input_micros=0, output_micros=4_000_000)
        batch_id = _batch(s, "7d", lines=2)
    _record(db, batch_id, 1)
    set_multipliers("7d=1.0")  # changed while the batch runs
    _record(db, batch_id, 2)
    assert _costs(db, batch_id) == [420, 420]  # both at 0.6, the quote when it was created
    with db() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None and batch.price_multiplier == Decimal("0.6")
        cost = cost_so_far(s, batch)
    assert (cost.cost_micros, cost.rates) == (840, Rates(input=600_000, cached_input=0, output=2_400_000))


def test_a_windows_own_price_row_is_not_multiplied(
    db: sessionmaker[Session], set_multipliers: Callable[[str], None]
) -> None:
    set_multipliers("7d=0.6")
    with db.begin() as s:
        set_price(
            s, model="m", input_micros=1_000_000, cached_input_micros=0, output_micros=4_000_000, completion_window="7d"
        )
        batch_id = _batch(s, "7d", lines=1)
    _record(db, batch_id, 1)
    assert _costs(db, batch_id) == [700]


def test_a_batch_from_before_the_multipliers_bills_at_1(
    db: sessionmaker[Session], set_multipliers: Callable[[str], None]
) -> None:
    set_multipliers("7d=0.6")
    with db.begin() as s:
        set_price(s, model="m", input_micros=1_000_000, cached_input_micros=0, output_micros=4_000_000)
        batch_id = _batch(s, "7d", lines=1)
        s.execute(update(Batch).where(Batch.id == batch_id).values(price_multiplier=None))  # as migration 0012 left it
    _record(db, batch_id, 1)
    assert _costs(db, batch_id) == [700]
