"""Per-window prices on SQLite and Postgres: the table the routes and the CLI show
(`jobs.billing.windows.window_prices`) and what the ledger bills a batch in a window
(`jobs.billing.ledger.record_usage`): the window's own price row, else the general one times the
window's multiplier from BACKFILL_WINDOW_PRICE_MULTIPLIERS, as stored on the batch when it was
created (tests/jobs/test_batch_price_multiplier.py: a setting changed later does not reach it)."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.billing.ledger import quoted_multiplier, set_price
from backfill.jobs.billing.models import Price, UsageLedgerEntry
from backfill.jobs.billing.windows import check_window, window_prices
from backfill.jobs.errors import InvalidRequest
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcome
from backfill.storage.process_state import reset as reset_process_state
from backfill.storage.settings import get_settings
from tests.factories import make_batch, make_team

WINDOWS = {"1h": 3600, "4h": 4 * 3600, "24h": 86400, "7d": 7 * 86400}
MULTIPLIERS = {"1h": Decimal(2), "4h": Decimal("1.5"), "7d": Decimal("0.6")}


@pytest.fixture
def multipliers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What `create_batch` stores on a batch: the process's settings."""
    monkeypatch.setenv("BACKFILL_WINDOW_PRICE_MULTIPLIERS", "1h=2,4h=1.5,7d=0.6")
    reset_process_state()
    yield
    reset_process_state()  # before the variable is restored, so the next reader sees it


def _general(s: Session, model: str = "m") -> Price:
    """$1 input, $0.50 cached input, $4 output per million tokens, 50% batch discount."""
    return set_price(s, model=model, input_micros=1_000_000, cached_input_micros=500_000, output_micros=4_000_000)


def test_the_table_per_window(db: sessionmaker[Session]) -> None:
    with db.begin() as s:
        assert window_prices(s, model="m", windows=WINDOWS, multipliers=MULTIPLIERS) == []
        general = _general(s)
        day = set_price(
            s,
            model="m",
            input_micros=800_000,
            cached_input_micros=400_000,
            output_micros=3_000_000,
            completion_window="24h",
        )
        _general(s, model="other")
        table = window_prices(s, model="m", windows=WINDOWS, multipliers=MULTIPLIERS)
    assert [(r.completion_window, r.seconds, r.priced_by, r.price.id, r.multiplier) for r in table] == [
        ("1h", 3600, "general", general.id, 2),
        ("4h", 4 * 3600, "general", general.id, Decimal("1.5")),
        ("24h", 86400, "window", day.id, 1),
        ("7d", 7 * 86400, "general", general.id, Decimal("0.6")),
    ]
    assert [(r.rates.input, r.rates.cached_input, r.rates.output) for r in table] == [
        (2_000_000, 1_000_000, 8_000_000),
        (1_500_000, 750_000, 6_000_000),
        (800_000, 400_000, 3_000_000),
        (600_000, 300_000, 2_400_000),
    ]


def test_a_batch_is_billed_at_its_windows_price(db: sessionmaker[Session], multipliers: None) -> None:
    with db.begin() as s:
        team = make_team(s, "t")
        general = _general(s)
        set_price(s, model="m", input_micros=3_000_000, cached_input_micros=0, output_micros=0, completion_window="4h")
        batches = {}
        for window in ("1h", "4h", "24h", "7d"):
            batch = make_batch(s, team, lines=1)
            batch.completion_window = window
            batch.price_multiplier = quoted_multiplier(window, get_settings().window_price_multipliers)
            batches[window] = batch.id
    with db.begin() as s:
        for window, batch_id in batches.items():
            assert claim_requests(s, batch_id=batch_id, limit=1, claim_token=window)
            outcome = Outcome(200, b"{}", "r", Usage(1000, 0, 100, 0))
            assert record_outcome(s, batch_id=batch_id, line=1, claim_token=window, outcome=outcome)
    with db() as s:
        ledger = {r.batch_id: r for r in s.execute(select(UsageLedgerEntry)).scalars()}
    cost = {window: ledger[batch_id].cost_micros for window, batch_id in batches.items()}
    # 1000 input tokens at $1/M and 100 output at $4/M, half off: 500 + 200 micros at 1x.
    assert cost == {"1h": 1400, "24h": 700, "7d": 420, "4h": 1500}  # 4h: its own row, $3/M input only
    assert ledger[batches["1h"]].price_version == general.id  # the row it was priced from


def test_an_unknown_window_is_openais_invalid_value() -> None:
    assert check_window("4h", WINDOWS) == 4 * 3600
    with pytest.raises(InvalidRequest) as refused:
        check_window("3d", WINDOWS)
    assert (refused.value.param, refused.value.code) == ("completion_window", "invalid_value")
    assert refused.value.message == "Invalid value: '3d'. Supported values are: '1h', '4h', '24h', '7d'."
