"""Claims sized by a model's own KV budget, on SQLite and Postgres: a budget published by a
model's own controller is held by that model's lines in flight only (`kv_models`)."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.validation.lines import prompt_text
from tests.jobs.test_prefix_claims import CHAT, T0, claim, new_batch, session_turns


def test_a_models_own_budget_is_held_by_that_models_lines_only(db: sessionmaker[Session]) -> None:
    """A budget published by a model's own controller (`kv_models`: its model) is the KV of that
    model's workers: another model's sessions in flight, on workers of their own, leave it whole.
    Against a budget every model shares (the deployment's) they count."""
    theirs, mine = [session_turns(80 + k, 3) for k in range(2)], [session_turns(90 + k, 3) for k in range(2)]
    largest = max(len(prompt_text(CHAT, s[2])) // 4 + 9 for s in (*theirs, *mine))
    budget = largest * 5 // 2  # room for two sessions at their largest, not three
    other = new_batch(db, [{**turn, "model": "other"} for s in theirs for turn in s])
    assert len(claim(db, other, 10, "o", budget=budget)) == 2  # both of the other model's sessions open
    batch_id = new_batch(db, [turn for s in mine for turn in s])

    def claim_with(kv_models: frozenset[str] | None) -> list[int]:
        with db.begin() as s:
            got = claim_requests(
                s,
                batch_id=batch_id,
                limit=10,
                claim_token="k",
                now=T0,
                kv_budget_tokens=budget,
                kv_models=kv_models,
            )
            return [r.line for r in got]

    assert claim_with(None) == []  # the shared budget is full of the other model's sessions
    assert sorted(claim_with(frozenset({"m"}))) == [1, 4]  # its own budget: both its sessions open
