"""Claims in prefix-tree order, on SQLite and Postgres: groups together, agent turns one after
another, the KV budget, and prefixes a team's other batch has in flight first."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.prefixes import TextBlocks
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcomes
from backfill.jobs.models import BatchStatus, utcnow
from backfill.jobs.validation.lines import prompt_text
from backfill.jobs.validation.outcome import apply_validation
from backfill.jobs.validation.scan import Limits, validate_lines
from tests.factories import make_submitted_batch, make_team

CHAT = "/v1/chat/completions"
LIMITS = Limits(max_requests=1000, max_line_bytes=1 << 20, max_errors=10)


def words(seed: int, n: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(n))


def chat(*messages: tuple[str, str]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], "max_tokens": 8}


def new_team(db: sessionmaker[Session]) -> str:
    with db.begin() as s:
        return make_team(s).id


def new_batch(db: sessionmaker[Session], bodies: list[dict[str, Any]], team_id: str | None = None) -> str:
    """A validated batch whose line i+1 is bodies[i]."""
    team_id = team_id or new_team(db)
    data = b"".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": b}).encode() + b"\n"
        for i, b in enumerate(bodies)
    )
    result = validate_lines([data], endpoint=CHAT, served_models=None, limits=LIMITS)
    assert result.errors == []
    with db.begin() as s:
        batch = make_submitted_batch(s, team_id)
        assert apply_validation(s, batch_id=batch.id, result=result) == BatchStatus.in_progress
        return batch.id


T0 = utcnow()


def claim(
    db: sessionmaker[Session], batch_id: str, limit: int, token: str, budget: int | None = None, at: float = 0.0
) -> list[int]:
    """Claim as a drain would `at` seconds into the test."""
    now = T0 + timedelta(seconds=at)
    with db.begin() as s:
        got = claim_requests(s, batch_id=batch_id, limit=limit, claim_token=token, now=now, kv_budget_tokens=budget)
        return [r.line for r in got]


def finish(db: sessionmaker[Session], batch_id: str, line: int, token: str, status: int = 200) -> None:
    outcome = Outcome(status_code=status, body=b"{}", request_id=None, usage=Usage())
    with db.begin() as s:
        assert record_outcomes(s, claim_token=token, results=[(batch_id, line, outcome)]) == 1


def session_turns(seed: int, turns: int) -> list[dict[str, Any]]:
    history: list[tuple[str, str]] = [("system", words(seed, 150))]
    out = []
    for t in range(turns):
        history = [*history, ("user", f"turn {t} " + words(seed * 100 + t, 80))]
        out.append(chat(*history))
        history = [*history, ("assistant", words(seed * 1000 + t, 80))]
    return out


def test_claims_take_one_prefix_group_at_a_time(db: sessionmaker[Session]) -> None:
    # Three tasks with a long preamble in common, their lines interleaved in the file.
    preamble = words(0, 400)
    systems = [f"{preamble} task {k} {words(k + 10, 150)}" for k in range(3)]
    bodies = [chat(("system", systems[i % 3]), ("user", f"q{i} " + words(50 + i, 60))) for i in range(18)]
    batch_id = new_batch(db, bodies)
    claims = [claim(db, batch_id, 6, "t", at=0.0), claim(db, batch_id, 6, "t", at=0.1)]
    # A prefix new to the fleet goes with one line first; nothing overtakes it while it warms.
    assert len(claims[0]) == 1 and claims[1] == []
    for k in range(2, 10):
        claims.append(claim(db, batch_id, 6, "t", at=float(k)))
    in_order = [line for c in claims for line in c]
    assert sorted(in_order) == list(range(1, 19))
    # One task after another; the next task's leader goes with the end of the one before.
    tasks = [(line - 1) % 3 for line in in_order]
    assert all(tasks[i] == tasks[6 * (i // 6)] for i in range(18)) and len(set(tasks)) == 3
    assert [len(c) for c in claims if c] == [1, 6, 6, 5]


def test_agent_turns_wait_for_the_previous_turn(db: sessionmaker[Session]) -> None:
    turns = session_turns(1, 3)
    other = chat(("user", "unrelated " + words(9, 100)))
    batch_id = new_batch(db, [turns[2], turns[0], other, turns[1]])  # lines 1..4
    assert sorted(claim(db, batch_id, 10, "a")) == [2, 3]  # turn 0 and the unrelated line
    assert claim(db, batch_id, 10, "b") == []  # turn 1 waits while turn 0 runs
    finish(db, batch_id, 2, "a")
    assert claim(db, batch_id, 10, "c") == [4]
    finish(db, batch_id, 4, "c", status=400)  # a failed turn still lets the next one go
    assert claim(db, batch_id, 10, "d") == [1]


def test_kv_budget_holds_back_new_sharing_work_but_not_unshared_lines(db: sessionmaker[Session]) -> None:
    a, b = session_turns(2, 2), session_turns(3, 2)
    unshared = [chat(("user", f"{i} alone " + words(70 + i, 20))) for i in range(3)]
    bodies = [a[0], a[1], b[0], b[1], *unshared]  # lines 1..7
    batch_id = new_batch(db, bodies)
    # Room for one session (it reserves its largest turn from the start) and the short
    # unshared lines, not for two sessions.
    budget = (len(prompt_text(CHAT, a[1])) // 4 + 9) * 3 // 2
    first = claim(db, batch_id, 10, "x", budget=budget)
    sessions = [line for line in first if line <= 4]
    assert len(sessions) == 1 and sessions[0] in (1, 3)  # one session opens, not two
    assert sorted(line for line in first if line > 4) == [5, 6, 7]
    assert claim(db, batch_id, 10, "y", budget=budget) == []
    # Without a budget both sessions open at once (once the first batch's warmed the first one).
    other = new_batch(db, bodies)
    assert sorted(claim(db, other, 10, "z", at=1.0)) == [1, 3, 5, 6, 7]


def test_prefixes_in_flight_for_the_team_go_first(db: sessionmaker[Session]) -> None:
    # Two system prompts; `later` sorts after `sooner` in prefix-tree order.
    def path(system: str) -> bytes:
        body = chat(("system", system), ("user", "q"))
        return TextBlocks().path(CHAT, body, prompt_text(CHAT, body))[0]

    p, q = words(20, 300), words(21, 300)
    sooner, later = (p, q) if path(p) < path(q) else (q, p)
    team = new_team(db)

    def lines(system: str, k: int, start: int) -> list[dict[str, Any]]:
        # Each user message starts with its own letter: the lines share exactly the system prompt.
        return [chat(("system", system), ("user", f"{'ABCDEFGH'[i]} " + words(300 + start + i, 60))) for i in range(k)]

    running = new_batch(db, lines(later, 4, 0), team_id=team)
    assert len(claim(db, running, 2, "r")) == 1  # `later` is in flight for this team
    mixed_bodies = lines(sooner, 4, 10) + lines(later, 4, 20)  # lines 1-4 sooner, 5-8 later
    same_team = new_batch(db, mixed_bodies, team_id=team)
    assert sorted(claim(db, same_team, 4, "s", at=1.0)) == [5, 6, 7, 8]
    # Another team's batch keeps plain tree order (the new prefix's leader first).
    assert claim(db, new_batch(db, mixed_bodies), 4, "t", at=1.0) in ([1], [2], [3], [4])


def test_a_prefix_stays_warm_while_its_lines_turn_over(db: sessionmaker[Session]) -> None:
    """Once a prefix has been served, its followers do not wait again just because every line
    in flight under it started less than a warm-up ago (short requests turn over faster)."""
    system = ("system", words(30, 300))
    batch_id = new_batch(db, [chat(system, ("user", f"{'ABCDEFGH'[i]} " + words(40 + i, 60))) for i in range(8)])
    leader = claim(db, batch_id, 4, "w", at=0.0)
    assert len(leader) == 1
    assert len(claim(db, batch_id, 2, "w", at=1.0)) == 2
    finish(db, batch_id, leader[0], "w")
    assert len(claim(db, batch_id, 2, "w", at=1.1)) == 2


def test_a_prefix_served_before_needs_no_leader_once_nothing_of_it_runs(db: sessionmaker[Session]) -> None:
    """A prefix whose lines have all finished (a lull, a drain ending and the next starting) was
    served: its blocks are cached, so its next lines go together, not one leader at a time (which
    trickled a one-prefix batch out a line per claim whenever leaders finished within a warm-up)."""
    system = ("system", words(31, 300))
    batch_id = new_batch(db, [chat(system, ("user", f"{'ABCDEFGH'[i]} " + words(50 + i, 60))) for i in range(8)])
    leader = claim(db, batch_id, 4, "v", at=0.0, budget=100_000)
    assert len(leader) == 1
    finish(db, batch_id, leader[0], "v")
    assert len(claim(db, batch_id, 4, "v", at=1.0, budget=100_000)) == 4


def test_a_sessions_next_turn_goes_once_the_previous_has_warmed(db: sessionmaker[Session]) -> None:
    """A line is a request of its own: the next turn waits only until the previous one's prompt
    is cached (PREFIX_WARM_S), not for its reply, so a session is not held to one request."""
    turns = session_turns(4, 3)
    batch_id = new_batch(db, turns)  # lines 1..3
    assert claim(db, batch_id, 10, "s", at=0.0) == [1]
    assert claim(db, batch_id, 10, "s", at=0.1) == []  # turn 0 sent too recently to be cached
    assert claim(db, batch_id, 10, "s", at=0.3) == [2]  # turn 0 still running
    assert claim(db, batch_id, 10, "s", at=0.4) == []
    assert claim(db, batch_id, 10, "s", at=0.6) == [3]


def test_a_sessions_turns_in_flight_count_once_against_the_kv_budget(db: sessionmaker[Session]) -> None:
    """A session's later turns do not hold other sessions back: however many of its turns are in
    flight, it counts once at its largest context, and its room goes to the next session as
    soon as it ends, while another session's turns still run."""
    a, b, c = session_turns(5, 3), session_turns(6, 3), session_turns(7, 3)
    batch_id = new_batch(db, [*a, *b, *c])  # sessions on lines 1-3, 4-6, 7-9
    largest = max(len(prompt_text(CHAT, s[2])) // 4 + 9 for s in (a, b, c))
    budget = largest * 5 // 2  # room for two sessions at their largest, not three
    first = claim(db, batch_id, 10, "k", budget=budget, at=0.0)
    opened = {(line - 1) // 3 for line in first}
    assert len(first) == 2 and len(opened) == 2 and all((line - 1) % 3 == 0 for line in first)
    waiting = ({0, 1, 2} - opened).pop()
    # Each open session's next turn goes while its first still runs, and the limit is used by
    # every line that may go; the third session still waits for room.
    second = sorted(claim(db, batch_id, 10, "k", budget=budget, at=0.3))
    assert second == sorted(3 * s + 2 for s in opened)
    third = sorted(claim(db, batch_id, 10, "k", budget=budget, at=0.6))
    assert third == sorted(3 * s + 3 for s in opened)
    assert claim(db, batch_id, 10, "k", budget=budget, at=0.9) == []
    done = min(opened)
    for t in range(3):
        finish(db, batch_id, 3 * done + 1 + t, "k")
    # The other session's three turns in flight count once: the waiting session fits now.
    assert claim(db, batch_id, 10, "k", budget=budget, at=1.0) == [3 * waiting + 1]


def test_lines_answered_but_not_yet_recorded_hold_no_kv(db: sessionmaker[Session]) -> None:
    """A drain's replies wait a moment to be recorded (its lines still read running): they no
    longer hold KV at the fleet, so the drain's next claim does not count them against the budget."""
    from sqlalchemy import select

    from backfill.jobs.models import BatchRequest

    system = ("system", words(60, 300))
    batch_id = new_batch(db, [chat(system, ("user", f"{'ABCDEFGH'[i]} " + words(70 + i, 60))) for i in range(8)])
    with db.begin() as s:
        rows = s.execute(
            select(BatchRequest.prefix_tokens, BatchRequest.kv_tokens).where(BatchRequest.batch_id == batch_id)
        ).all()
    prefix, own = rows[0][0], max(kv - p for p, kv in rows)
    assert prefix > 0 and all(p == prefix for p, _ in rows)
    budget = prefix + 2 * own  # the shared prefix and two lines' own tokens

    def claim_with(at: float, answered: frozenset[tuple[str, int]] = frozenset()) -> list[int]:
        with db.begin() as s:
            got = claim_requests(
                s,
                batch_id=batch_id,
                limit=4,
                claim_token="d",
                now=T0 + timedelta(seconds=at),
                kv_budget_tokens=budget,
                answered=answered,
            )
            return [r.line for r in got]

    first = claim_with(0.0) + claim_with(1.0)  # the leader, then one more: the budget is full
    assert len(first) == 2
    assert claim_with(1.1) == []
    # Both answered, their records on the way: two more fit, and the prefix needs no leader.
    assert len(claim_with(1.2, answered=frozenset((batch_id, line) for line in first))) == 2
