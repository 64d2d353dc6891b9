"""A model with no price in force is said once per model, not once per group of results: a
400-line batch recorded in groups used to log it dozens of times."""

from __future__ import annotations

import logging
import secrets

import pytest
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.billing.ledger import record_usage
from backfill.jobs.execution.replies import outcome_of
from tests.factories import make_batch, make_team

REPLY = b'{"id":"r","object":"chat.completion","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'


def test_a_missing_price_is_said_once_per_model(db: sessionmaker[Session], caplog: pytest.LogCaptureFixture) -> None:
    models = [f"unpriced-{secrets.token_hex(3)}" for _ in range(2)]
    with db.begin() as s:
        team = make_team(s)
        batches = [make_batch(s, team, lines=400, model=m) for m in models for _ in range(2)]
    caplog.set_level(logging.WARNING, logger="backfill")
    for batch in batches:
        for first in range(1, 401, 20):  # groups of 20 results, each its own transaction
            with db.begin() as s:
                record_usage(s, batch, [(n, outcome_of(200, REPLY, None)) for n in range(first, first + 20)])
    said = [r.getMessage() for r in caplog.records if "no price in force" in r.getMessage()]
    assert len(said) == 2, said
    assert all(any(m in line for line in said) for m in models)
