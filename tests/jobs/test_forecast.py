"""`jobs.billing.forecast`: a batch's cost so far, the price in force now, the fleet's batch throughput
and queue, and the completion forecast, on a migrated SQLite file and a scratch Postgres."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.billing.forecast import batch_throughput, completion_forecast, cost_so_far, price_now
from backfill.jobs.billing.ledger import component_cost, set_price
from backfill.jobs.billing.models import UsageLedgerEntry
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcome
from backfill.jobs.models import Batch, BatchStatus, utcnow
from tests.factories import make_batch, make_team


def _ok(prompt: int, cached: int, completion: int) -> Outcome:
    return Outcome(200, b"{}", "req", Usage(prompt, cached, completion, 0))


def test_cost_so_far_is_the_ledger_at_the_batch_price(db: sessionmaker[Session]) -> None:
    with db.begin() as s:
        team = make_team(s, "t")
        price = set_price(s, model="m", input_micros=150_000, cached_input_micros=75_000, output_micros=600_000)
        batch_id = make_batch(s, team, lines=3).id
        unpriced_id = make_batch(s, team, lines=1, model="free").id
    with db.begin() as s:
        claim_requests(s, batch_id=batch_id, limit=3, claim_token="a")
        assert record_outcome(s, batch_id=batch_id, line=1, claim_token="a", outcome=_ok(4077, 4032, 4))
        assert record_outcome(s, batch_id=batch_id, line=2, claim_token="a", outcome=_ok(100, 0, 5))
        # A failed request costs nothing and is not a billed request.
        failed = Outcome(400, b"{}", None, Usage(50, 0, 0, 0))
        assert record_outcome(s, batch_id=batch_id, line=3, claim_token="a", outcome=failed)
    with db() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None
        cost = cost_so_far(s, batch)
        assert cost.price is not None and cost.price.id == price.id
        assert (cost.requests, cost.prompt_tokens, cost.cached_tokens, cost.completion_tokens) == (2, 4177, 4032, 9)
        expected = 155 + component_cost(100, 150_000, 50) + component_cost(5, 600_000, 50)
        assert cost.cost_micros == expected
        unpriced = s.get(Batch, unpriced_id)
        assert unpriced is not None
        nothing = cost_so_far(s, unpriced)
        assert (nothing.cost_micros, nothing.requests, nothing.price) == (0, 0, None)


def test_price_now_is_what_a_batch_created_now_is_billed_at(db: sessionmaker[Session]) -> None:
    with db.begin() as s:
        assert price_now(s, model="m", completion_window="24h") is None  # no price ever set
        general = set_price(s, model="m", input_micros=1, cached_input_micros=1, output_micros=1)
        hour = set_price(s, model="m", input_micros=2, cached_input_micros=2, output_micros=2, completion_window="1h")
        set_price(
            s,
            model="m",
            input_micros=3,
            cached_input_micros=3,
            output_micros=3,
            effective_from=utcnow() + timedelta(days=1),
        )
        set_price(s, model="other", input_micros=4, cached_input_micros=4, output_micros=4)
    with db.begin() as s:
        now_24h = price_now(s, model="m", completion_window="24h")
        now_1h = price_now(s, model="m", completion_window="1h")
        assert now_24h is not None and now_24h.id == general.id  # the future price waits its turn
        assert now_1h is not None and now_1h.id == hour.id  # a window's own price wins
        assert price_now(s, model="unpriced", completion_window="24h") is None
        # The same row the ledger will bill a batch created now at.
        team = make_team(s, "p")
        batch = make_batch(s, team, lines=1)
        assert cost_so_far(s, batch).price == now_24h


def test_throughput_is_the_recent_ledger_and_the_queue_of_running_batches(db: sessionmaker[Session]) -> None:
    now = utcnow()
    with db.begin() as s:
        a, b = make_team(s, "a"), make_team(s, "b")
        running = make_batch(s, a, lines=4)
        other_model = make_batch(s, b, lines=2, model="n")
        done = make_batch(s, b, lines=3)
        for batch in (running, other_model, done):
            batch.token_estimate = 100 * batch.total  # as validation sets it: the lines' estimates summed
    with db.begin() as s:
        claim_requests(s, batch_id=running.id, limit=2, claim_token="a")
        assert record_outcome(s, batch_id=running.id, line=1, claim_token="a", outcome=_ok(30, 0, 10))
        # Line 2 stays running (in flight): still queued.
        claim_requests(s, batch_id=other_model.id, limit=1, claim_token="b")
        assert record_outcome(s, batch_id=other_model.id, line=1, claim_token="b", outcome=_ok(7, 0, 3))
        claim_requests(s, batch_id=done.id, limit=1, claim_token="c")
        assert record_outcome(s, batch_id=done.id, line=1, claim_token="c", outcome=_ok(500, 0, 500))
        s.execute(update(Batch).where(Batch.id == done.id).values(status=BatchStatus.completed))
        # When each entry was recorded: 5 s and 25 s before `now` (two 10 s steps of a minute's
        # window), and long ago for the batch that is over (outside any window).
        for batch_id, ago in ((running.id, 5), (other_model.id, 25), (done.id, 7200)):
            s.execute(
                update(UsageLedgerEntry)
                .where(UsageLedgerEntry.batch_id == batch_id)
                .values(recorded_at=now - timedelta(seconds=ago))
            )
    with db() as s:
        every = batch_throughput(s, window_s=60, now=now)
        assert (every.requests, every.tokens, every.busy_s) == (2, 50, 20)
        assert every.tokens_per_second == 50 / 60 and every.requests_per_second == 2 / 60
        assert every.busy_tokens_per_second == 50 / 20 and every.busy_requests_per_second == 2 / 20
        # Lines left in in_progress batches, from their counters: 3 of `running` (one in flight),
        # 1 of `other_model`, each with its share of its batch's estimate.
        assert (every.queued_requests, every.queued_tokens, every.running_batches) == (4, 400, 2)
        one = batch_throughput(s, window_s=60, model="m", now=now)
        assert (one.requests, one.tokens, one.busy_s, one.busy_tokens_per_second) == (1, 40, 10, 4.0)
        assert (one.queued_requests, one.queued_tokens, one.running_batches) == (3, 300, 1)
        # A window that ends before anything was recorded sees nothing done, busy nowhere.
        empty = batch_throughput(s, window_s=60, now=now - timedelta(minutes=5))
        assert (empty.requests, empty.tokens, empty.busy_s) == (0, 0, 0)
        assert empty.tokens_per_second == empty.busy_tokens_per_second == 0.0
        # A 15 s window holds the newest entry only, busy for at most the window.
        short = batch_throughput(s, window_s=15, now=now)
        assert (short.requests, short.tokens, short.busy_s) == (1, 40, 10)
        # Three hours back, the old entry counts too.
        wide = batch_throughput(s, window_s=3 * 3600, now=now)
        assert (wide.requests, wide.tokens, wide.busy_s) == (3, 1050, 30)


def test_completion_forecast() -> None:
    now = utcnow()
    f = completion_forecast(now=now, tokens=500, queued_tokens=1500, tokens_per_second=100.0, window_s=300)
    assert f.at == now + timedelta(seconds=20) and f.seconds == 20 and f.reason is None
    idle = completion_forecast(now=now, tokens=500, queued_tokens=0, tokens_per_second=0.0, window_s=300)
    assert idle.at is None and idle.reason is not None and "last 300s" in idle.reason
    far = completion_forecast(now=now, tokens=10**15, queued_tokens=0, tokens_per_second=1e-3, window_s=60)
    assert far.at is None and far.reason is not None and "year" in far.reason
