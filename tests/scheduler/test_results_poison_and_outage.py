"""The recorder between a drain's fleet calls and the database: a result the database refuses
does not take the others down with it (the line spends an attempt, and past the cap fails), and a
database that goes away for a while loses nothing: the replies wait and are written once."""

from __future__ import annotations

import asyncio
import threading
import time

import orjson
import psycopg
from sqlalchemy import text
from sqlalchemy.engine import make_url

from backfill.devfleet.services import PG_ADMIN_URL
from backfill.jobs.execution.claims import ClaimedRequest
from backfill.jobs.execution.results import ATTEMPTS_EXCEEDED
from backfill.jobs.models import Batch, RequestState
from backfill.scheduler.drain.recorder import Answer, Done, Recorder
from backfill.scheduler.fleet.client import FleetReply
from backfill.storage.db import unit_of_work
from tests.scheduler.test_reclaim import lines_of, running_batch
from tests.scheduler.test_reclaim import scratch_db as scratch_db  # the fixture

TOKEN = "drain-recorder"


def _claimed(batch_id: str, line: int, attempts: int = 0) -> ClaimedRequest:
    return ClaimedRequest(
        batch_id=batch_id,
        line=line,
        custom_id=f"r{line}",
        offset=0,
        length=1,
        attempts=attempts,
        input_key="k",
        endpoint="/v1/chat/completions",
        token_estimate=1,
    )


def _body(prompt_tokens: int = 3) -> bytes:
    return orjson.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 2}})


def _answer(prompt_tokens: int = 3) -> Answer:
    return Answer.of(FleetReply(200, _body(prompt_tokens), None, 0.01, transient=False))


async def _record(recorder: Recorder, items: list[Done]) -> None:
    writer = asyncio.create_task(recorder.run())
    for item in items:
        await recorder.put(item)
    await recorder.queue.put(None)
    await writer


def test_a_result_the_database_refuses_spends_an_attempt_and_spares_the_rest(scratch_db: str) -> None:
    batch_id = running_batch(6, token=TOKEN)
    with unit_of_work() as s:
        s.query(type(lines_of(batch_id)[0])).filter_by(batch_id=batch_id, line=6).update({"attempts": 2})
    # A status the column cannot hold (a 32-bit integer): the database refuses that one result.
    # (Absurd usage figures no longer do: they are clamped when the reply is parsed.)
    poison = Answer.of(FleetReply(2**40, _body(), None, 0.01, transient=False))
    items = [Done(_claimed(batch_id, n), _answer()) for n in range(1, 5)]
    items += [Done(_claimed(batch_id, 5), poison), Done(_claimed(batch_id, 6, attempts=2), poison)]
    recorder = Recorder(holder=TOKEN, max_attempts=3, patience_s=5, finish_by=lambda: None)
    asyncio.run(_record(recorder, items))
    rows = {r.line: r for r in lines_of(batch_id)}
    assert [rows[n].state for n in range(1, 5)] == [RequestState.succeeded] * 4
    assert (rows[5].state, rows[5].attempts, rows[5].claim_token) == (RequestState.pending, 1, None)
    assert (rows[6].state, rows[6].status_code) == (RequestState.failed, 500)
    assert orjson.loads(rows[6].response_body or "")["error"]["code"] == ATTEMPTS_EXCEEDED
    with unit_of_work() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None and (batch.completed, batch.failed) == (4, 1)


def _outage(db_url: str, seconds: float) -> threading.Thread:
    """Refuse new connections to the test's database and cut the open ones, for `seconds`."""
    name = make_url(db_url).database

    def run() -> None:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            try:
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                        (name,),
                    )
                    time.sleep(0.1)
            finally:
                conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_replies_wait_out_a_database_outage_and_are_written_once(scratch_db: str) -> None:
    batch_id = running_batch(40, token=TOKEN)
    recorder = Recorder(holder=TOKEN, max_attempts=3, patience_s=30, finish_by=lambda: None)
    seen_down: list[bool] = []

    async def watch() -> None:
        while True:
            if not recorder.db_ok.is_set():
                seen_down.append(True)
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        writer = asyncio.create_task(recorder.run())
        watcher = asyncio.create_task(watch())
        await recorder.put(Done(_claimed(batch_id, 1), _answer()))  # before the outage
        while lines_of(batch_id)[0].state != RequestState.succeeded:
            await asyncio.sleep(0.05)
        outage = _outage(scratch_db, 3.0)
        await asyncio.sleep(0.3)
        for n in range(2, 41):
            await recorder.put(Done(_claimed(batch_id, n), _answer()))
            await asyncio.sleep(0.02)
        await asyncio.to_thread(outage.join)
        await recorder.queue.put(None)
        await writer
        watcher.cancel()

    started = time.monotonic()
    asyncio.run(scenario())
    assert seen_down, "the recorder never saw the database go away"
    assert time.monotonic() - started >= 3.0
    rows = lines_of(batch_id)
    assert [r.state for r in rows] == [RequestState.succeeded] * 40
    assert not recorder.given_up
    with unit_of_work() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None and batch.completed == 40  # each written once
        ledger = s.execute(
            text("SELECT count(*), count(DISTINCT line) FROM usage_ledger WHERE batch_id = :b"), {"b": batch_id}
        ).one()
    assert tuple(ledger) == (40, 40)


def test_a_database_away_longer_than_the_patience_gives_the_replies_up(scratch_db: str) -> None:
    batch_id = running_batch(3, token=TOKEN)
    recorder = Recorder(holder=TOKEN, max_attempts=3, patience_s=1.0, finish_by=lambda: None)
    outage = _outage(scratch_db, 4.0)
    time.sleep(0.3)
    started = time.monotonic()
    asyncio.run(_record(recorder, [Done(_claimed(batch_id, n), _answer()) for n in (1, 2, 3)]))
    gave_up_after = time.monotonic() - started
    outage.join()
    assert len(recorder.given_up) == 3 and gave_up_after < 3.5
    # Still held by the claim: the reconciler takes them back once this drain's heartbeat lapses.
    assert [r.state for r in lines_of(batch_id)] == [RequestState.running] * 3
