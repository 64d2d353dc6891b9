"""Claims on request lines: taking pending lines to run, and giving them back.

A claim is a token written on each line it holds; every write here is a compare-and-set on the
line's state and that token, so a slow worker presumed dead cannot touch lines claimed since.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Select, Table, Update, and_, bindparam, func, or_, select, update
from sqlalchemy.orm import Session

from backfill.jobs.execution.prefixes import PREFIX_WARM_S
from backfill.jobs.files import file_key
from backfill.jobs.models import RUNNING_LINES, SERVED_LINES, Batch, BatchRequest, BatchStatus, RequestState, utcnow

HOT_PREFIXES = 32  # shared prefixes in flight that another batch's claim looks for first
SCAN_LINES = 4096  # pending lines of a batch, in tree order, a claim looks through

# A claim's statements are built once, on the table's columns, with their values bound at each
# claim: building them afresh (the ORM's expressions, then their cache keys) cost a drain more
# CPU than running them, and a drain claims a few lines at a time, many times a second.
_LINES = cast(Table, BatchRequest.__table__)
_BATCHES = cast(Table, Batch.__table__)


@dataclass(frozen=True)
class ClaimedRequest:
    batch_id: str
    line: int
    custom_id: str
    offset: int
    length: int
    attempts: int
    input_key: str
    endpoint: str
    token_estimate: int


def claim_requests(
    session: Session,
    *,
    batch_id: str,
    limit: int,
    claim_token: str,
    now: datetime | None = None,
    kv_budget_tokens: int | None = None,
    answered: Collection[tuple[str, int]] = frozenset(),
    kv_models: Collection[str] | None = None,
) -> list[ClaimedRequest]:
    """Move up to `limit` pending lines of one batch to running under `claim_token`.

    Lines go in prefix-tree order (`jobs.execution.prefixes`): the requests under one prefix together,
    a prompt before the prompts extending it, and a line whose `after_line` (an agent trace's
    previous turn) has not been in flight for PREFIX_WARM_S waits: by then that turn's prompt is
    cached, and a line of a batch is a request of its own, so the turn need not wait for the
    previous one's reply (which would hold each session to one request at a time). A prefix new
    to the fleet goes with one line first, the others once it has warmed the cache. Lines under a
    prefix that the team's other running batches of the same model have in flight go first, so
    batches sharing prefixes share the cache too. With `kv_budget_tokens` (the fleet's KV cache
    open to batch work), new sharing work (a prefix group, an agent session) starts only while
    what is in flight fits it (each shared prefix counted once, plus each line's own tokens,
    each agent session once at its largest context however many of its turns are in flight or
    between two turns); lines sharing nothing are not held back. Lines still running whose
    answers are in (`answered`, (batch, line): the claiming drain's replies not yet recorded) hold
    no KV any more: they count as served, not in flight. `kv_models`: the models whose lines in
    flight hold that budget (a model's own workers' budget: that model's; None: every model's).
    The batches and how many lines each get are the planner's choice, made before.
    """
    now = now or utcnow()
    # FOR KEY SHARE: claims do not wait on each other or on recorded results, but an expiry
    # (FOR UPDATE on the row, `jobs.sweeps.expire_overdue`) waits for this claim to commit, and
    # a claim that comes after it finds the batch no longer in progress.
    batch = session.get(Batch, batch_id, with_for_update={"read": True, "key_share": True})
    if batch is None or batch.status != BatchStatus.in_progress or limit <= 0:
        return []
    # Look no further than this many pending lines into the tree: a claim costs the same in a
    # batch of a million lines, and what lies beyond cannot be due before what lies within.
    bound = session.execute(_bound_statement(), {"batch_id": batch_id}).scalar_one_or_none()
    footprint = _InFlight.load(
        session, team_id=batch.team_id, model=batch.model, now=now, answered=answered, kv_models=kv_models
    )
    ready = {
        "batch_id": batch_id,
        "now": now,
        "warmed_before": now - timedelta(seconds=PREFIX_WARM_S),
        "bound": bound,
    }
    if kv_budget_tokens is not None and _has_sessions(session, batch):
        waiting = _ready_statement(continuations=True, bounded=bound is not None)
        footprint.reserve(batch_id, session.execute(waiting, {**ready, "limit": SCAN_LINES}))
    hot = footprint.hot_prefixes
    locked = session.get_bind().dialect.name == "postgresql"
    picked: list[_Candidate] = []
    if hot:
        pick = _ready_statement(bounded=bound is not None, hot=True, locked=locked)
        picked = _picked(session, pick, {**ready, "hot": hot, "limit": limit})
    if len(picked) < limit:
        pick = _ready_statement(bounded=bound is not None, skip=bool(picked), locked=locked)
        skip = {"skip": [p.line for p in picked]} if picked else {}
        picked += _picked(session, pick, {**ready, **skip, "limit": limit - len(picked)})
    # A shared prefix not warm in flight (just sent, or nothing of it running now) may have been
    # served long before: then its blocks are cached and its lines need no leader. Without this,
    # a prefix whose lines all finished (a drain's lull, the next drain's first claim) went one
    # line at a time while each leader finished before it had warmed.
    cooling = {c.prefix_hash for c in picked if c.prefix_tokens} - footprint.warm
    if cooling:
        footprint.warm |= _served_since(session, batch_id=batch_id, prefixes=cooling, now=now)
    lines = footprint.admit(picked, kv_budget_tokens)
    if not lines:
        return []
    # One round trip: the compare-and-set and the claimed lines' columns (no ORM rows to build).
    returned = session.execute(
        _claim_statement(), {"of_batch": batch_id, "of_lines": lines, "token": claim_token, "at": now}
    ).all()
    rows = sorted(returned, key=lambda r: (r.prefix_rank, r.line))  # RETURNING keeps no order
    key = file_key(batch.team_id, batch.input_file_id)
    return [
        ClaimedRequest(
            batch_id=batch_id,
            line=r.line,
            custom_id=r.custom_id,
            offset=r.offset,
            length=r.length,
            attempts=r.attempts,
            input_key=key,
            endpoint=batch.endpoint,
            token_estimate=r.token_estimate,
        )
        for r in rows
    ]


def claim_overflow(
    session: Session, *, batch_id: str, share: int, limit: int, claim_token: str, mark: str
) -> list[ClaimedRequest]:
    """Claim up to `limit` pending lines of a batch for an overflow deployment, never more than
    its overflow `share` (the lines of its remaining ones the escalation sends there) less those
    running there already: each claimed line is marked running there (`mark` in its request_id,
    until its answer is recorded or it is claimed again), and claims of one batch's overflow lines
    wait for each other, so drains claiming at once never pass the share between them. (Lines
    done there have left the batch's remaining lines, so they are out of the share already.)"""
    if limit <= 0 or share <= 0:
        return []
    # FOR NO KEY UPDATE: waits for another overflow claim of this batch (and a recorder's counter
    # update) for the span of a claim, not for the fleet paths' claims (FOR KEY SHARE).
    batch = session.get(Batch, batch_id, with_for_update={"key_share": True})
    if batch is None or batch.status != BatchStatus.in_progress:
        return []
    running = session.execute(
        select(func.count())
        .select_from(BatchRequest)
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.state == RequestState.running,
            BatchRequest.request_id == mark,
        )
    ).scalar_one()
    claimed = claim_requests(
        session, batch_id=batch_id, limit=min(limit, share - running), claim_token=claim_token, kv_budget_tokens=None
    )
    if claimed:
        session.execute(
            update(BatchRequest)
            .where(
                BatchRequest.batch_id == batch_id,
                BatchRequest.line.in_([r.line for r in claimed]),
                BatchRequest.claim_token == claim_token,
            )
            .values(request_id=mark)
            .execution_options(synchronize_session=False)
        )
    return claimed


@dataclass(frozen=True)
class _Candidate:
    line: int
    prefix_hash: str
    prefix_tokens: int
    kv_tokens: int
    after_line: int | None

    @property
    def own_tokens(self) -> int:
        """The KV beyond its shared prefix."""
        return max(self.kv_tokens - self.prefix_tokens, 0)


@functools.cache
def _bound_statement() -> Select[int]:
    """The prefix rank SCAN_LINES pending lines into a batch's tree (none: fewer are pending)."""
    c = _LINES.c
    return (
        select(c.prefix_rank)
        .where(c.batch_id == bindparam("batch_id"), c.state == RequestState.pending.value)
        .order_by(c.prefix_rank, c.line)
        .offset(SCAN_LINES)
        .limit(1)
    )


@functools.cache
def _ready_statement(
    *, continuations: bool = False, bounded: bool = False, hot: bool = False, skip: bool = False, locked: bool = False
) -> Select[int, str, int, int, int | None]:
    """Pending lines of a batch (`batch_id`) that may run `now`, in prefix-tree order, at most
    `limit` (with `continuations`, only the next turns of sessions whose previous turn has
    warmed the cache, claimed before `warmed_before`, or finished). `bounded`: no further into
    the tree than `bound`; `hot`: only lines under the prefixes `hot`; `skip`: not the lines
    `skip`; `locked`: locked against other claimers, who skip them (Postgres)."""
    c = _LINES.c
    previous = _LINES.alias("previous")
    previous_unfinished = (  # pending, or sent too recently for its prompt to be cached yet
        select(previous.c.line)
        .where(
            previous.c.batch_id == c.batch_id,
            previous.c.line == c.after_line,
            or_(
                previous.c.state == RequestState.pending.value,
                and_(
                    previous.c.state == RequestState.running.value,
                    or_(previous.c.claimed_at.is_(None), previous.c.claimed_at > bindparam("warmed_before")),
                ),
            ),
        )
        .exists()
    )
    pick = (
        select(c.line, c.prefix_hash, c.prefix_tokens, c.kv_tokens, c.after_line)
        .where(
            c.batch_id == bindparam("batch_id"),
            c.state == RequestState.pending.value,
            or_(c.not_before.is_(None), c.not_before <= bindparam("now")),
        )
        .order_by(c.prefix_rank, c.line)
    )
    if continuations:
        pick = pick.where(c.after_line.is_not(None), ~previous_unfinished)
    else:
        pick = pick.where(or_(c.after_line.is_(None), ~previous_unfinished))
    if bounded:
        pick = pick.where(c.prefix_rank <= bindparam("bound"))
    if hot:
        pick = pick.where(c.prefix_hash.in_(bindparam("hot", expanding=True)))
    if skip:
        pick = pick.where(c.line.not_in(bindparam("skip", expanding=True)))
    pick = pick.limit(bindparam("limit"))
    return pick.with_for_update(of=_LINES, skip_locked=True) if locked else pick


@functools.cache
def _claim_statement() -> Update:
    """The claim's compare-and-set on the lines picked, returning their columns (one round trip,
    no ORM rows to build)."""
    c = _LINES.c
    return (
        update(_LINES)
        .where(c.batch_id == bindparam("of_batch"), c.line.in_(bindparam("of_lines", expanding=True)))
        .where(c.state == RequestState.pending.value)
        # request_id: a running line's mark of where it was sent (`claim_overflow`); a line sent to
        # the overflow and given back is claimed afresh, wherever it goes next.
        .values(
            state=RequestState.running.value,
            claim_token=bindparam("token", type_=c.claim_token.type),
            claimed_at=bindparam("at", type_=c.claimed_at.type),
            request_id=None,
        )
        .returning(c.line, c.custom_id, c.offset, c.length, c.attempts, c.token_estimate, c.prefix_rank)
    )


# Whether a batch has agent sessions (lines with an `after_line`), per batch once known for good:
# a line's `after_line` never changes once written, so one found settles it, and none found once
# every line is indexed settles it too. A claim then skips reading the sessions between two turns
# (a scan of up to SCAN_LINES pending lines) in a batch that has none. Bounded: cleared when full.
_SESSIONS: dict[str, bool] = {}
_SESSIONS_KNOWN_MAX = 4096


def _has_sessions(session: Session, batch: Batch) -> bool:
    """Whether any line of the batch waits for a previous turn."""
    known = _SESSIONS.get(batch.id)
    if known is not None:
        return known
    found = (
        session.execute(
            select(BatchRequest.line)
            .where(BatchRequest.batch_id == batch.id, BatchRequest.after_line.is_not(None))
            .limit(1)
        ).first()
        is not None
    )
    if found or batch.unindexed == 0:
        if len(_SESSIONS) >= _SESSIONS_KNOWN_MAX:
            _SESSIONS.clear()
        _SESSIONS[batch.id] = found
    return found


def _served_since(session: Session, *, batch_id: str, prefixes: set[str], now: datetime) -> set[str]:
    """Which of these prefixes a line of the batch began at least PREFIX_WARM_S ago."""
    warmed_before = now - timedelta(seconds=PREFIX_WARM_S)
    out = set()
    for prefix_hash in prefixes:
        found = session.execute(
            select(BatchRequest.line)
            .where(
                BatchRequest.batch_id == batch_id,
                SERVED_LINES,
                BatchRequest.prefix_hash == prefix_hash,
                BatchRequest.claimed_at <= warmed_before,
            )
            .limit(1)
        ).first()
        if found is not None:
            out.add(prefix_hash)
    return out


def _picked(session: Session, pick: Select[int, str, int, int, int | None], values: dict[str, Any]) -> list[_Candidate]:
    return [_Candidate(*row) for row in session.execute(pick, values)]


@functools.cache
def _running_statement() -> Select[str, int, int | None, str, int, int, datetime | None, str, str | None]:
    """Every running line's share of the KV, with its batch's team and model."""
    c, b = _LINES.c, _BATCHES.c
    return (
        select(
            c.batch_id,
            c.line,
            c.after_line,
            c.prefix_hash,
            c.prefix_tokens,
            c.kv_tokens,
            c.claimed_at,
            b.team_id,
            b.model,
        )
        .join(_BATCHES, b.id == c.batch_id)
        .where(RUNNING_LINES)  # the partial index of running lines, which a bound state cannot use
    )


@dataclass
class _InFlight:
    """The KV that batch work holds in the fleet's cache: each shared prefix once, plus every
    running line's own tokens. An agent session counts once, at its largest context (every
    turn's `kv_tokens`), however many of its turns are in flight: they extend one another, so
    the engine holds their common blocks once."""

    prefixes: dict[str, int]
    own_tokens: int
    hot_prefixes: list[str]  # shared prefixes in flight for the same team and model
    warm: set[str]  # shared prefixes in flight whose blocks the fleet has had time to cache
    running: set[tuple[str, int]] = field(default_factory=set)  # (batch, line) in flight
    reserved: set[int] = field(default_factory=set)  # lines of this batch counted already

    @classmethod
    def load(
        cls,
        session: Session,
        *,
        team_id: str,
        model: str | None,
        now: datetime,
        answered: Collection[tuple[str, int]] = frozenset(),
        kv_models: Collection[str] | None = None,
    ) -> _InFlight:
        rows = session.execute(_running_statement()).all()
        if kv_models is not None:  # other models' lines run on workers of their own: not this budget's
            rows = [row for row in rows if row.model in kv_models]
        running = {(batch_id, line) for batch_id, line, *_ in rows} - set(answered)
        prefixes: dict[str, int] = {}
        hot: dict[str, None] = {}
        warm: set[str] = set()
        own = 0
        warmed_before = now - timedelta(seconds=PREFIX_WARM_S)
        for batch_id, line, after_line, prefix_hash, prefix_tokens, kv_tokens, claimed_at, team, row_model in rows:
            if (batch_id, line) not in running:  # answered, its record on the way: its prefix is cached
                if prefix_tokens:
                    warm.add(prefix_hash)
                continue
            if after_line is not None and (batch_id, after_line) in running:
                continue  # a later turn of a session in flight: its earliest running turn counts it
            own += max(kv_tokens - prefix_tokens, 0)
            if prefix_tokens:
                prefixes[prefix_hash] = prefix_tokens
                if claimed_at is None or claimed_at <= warmed_before:
                    warm.add(prefix_hash)
                if team == team_id and row_model == model and len(hot) < HOT_PREFIXES:
                    hot[prefix_hash] = None
        return cls(prefixes, own, list(hot), warm, running)

    def reserve(self, batch_id: str, continuations: Iterable[Sequence[Any]]) -> None:
        """Count the sessions between two turns (rows of lines whose previous turn finished):
        their context is in the cache, and evicting it would lose the next turn's hit. A next
        turn whose previous one is still in flight is that session's, counted already."""
        for row in continuations:
            c = _Candidate(*row)
            self.reserved.add(c.line)
            if (batch_id, c.after_line) in self.running:
                continue
            self.own_tokens += c.own_tokens
            if c.prefix_tokens:
                self.prefixes.setdefault(c.prefix_hash, c.prefix_tokens)
                self.warm.add(c.prefix_hash)

    def admit(self, candidates: list[_Candidate], budget: int | None) -> list[int]:
        """The candidates that may go, in order.

        A session's next turn always goes (its session is counted already). A
        prefix new to the fleet goes with one line first: the others follow once that one has
        had PREFIX_WARM_S to be scheduled, so they find its blocks cached (and the router
        finds the worker) instead of all computing them at once. Once a line sharing a prefix
        must wait, for the leader or for room in the KV budget, no later sharing line goes (a
        later prefix must not overtake it); lines sharing nothing still do. Something always
        runs when nothing is in flight.
        """
        used = sum(self.prefixes.values()) + self.own_tokens
        out: list[int] = []
        full = False
        for c in candidates:
            new_prefix = c.prefix_tokens if c.prefix_hash not in self.prefixes else 0
            if c.after_line is None and c.prefix_tokens > 0:
                waiting = c.prefix_hash in self.prefixes and c.prefix_hash not in self.warm
                too_big = budget is not None and used > 0 and used + new_prefix + c.own_tokens > budget
                full = full or waiting or too_big
                if full:
                    continue
            out.append(c.line)
            if c.line not in self.reserved:
                used += new_prefix + c.own_tokens
            if c.prefix_tokens:
                self.prefixes.setdefault(c.prefix_hash, c.prefix_tokens)
        return out


def release_for_retry(
    session: Session, *, batch_id: str, line: int, claim_token: str, not_before: datetime, spend_attempt: bool = True
) -> bool:
    """Put a line back to pending after a transient failure, with a backoff time. A request that
    never reached the fleet (every deployment's circuit open) waits without spending an attempt."""
    result = session.execute(
        update(BatchRequest)
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.line == line,
            BatchRequest.state == RequestState.running,
            BatchRequest.claim_token == claim_token,
        )
        .values(
            state=RequestState.pending,
            attempts=BatchRequest.attempts + (1 if spend_attempt else 0),
            not_before=not_before,
            claim_token=None,
        )
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def requeue_unstarted(session: Session, *, batch_id: str, lines: Sequence[int], claim_token: str) -> None:
    """Give back claimed lines that were never sent (capacity withdrawn): no attempt spent."""
    if lines:
        session.execute(
            update(BatchRequest)
            .where(
                BatchRequest.batch_id == batch_id,
                BatchRequest.line.in_(list(lines)),
                BatchRequest.state == RequestState.running,
                BatchRequest.claim_token == claim_token,
            )
            .values(state=RequestState.pending, claim_token=None)
            .execution_options(synchronize_session=False)
        )
