"""A drain's claim stage: take the lines the planner releases, and read their bodies.

The claim itself is a compare-and-set in the database (`jobs.execution.claims`); the bodies stay in the
batch's input file in the object store, read back by ranges.
"""

from __future__ import annotations

from collections.abc import Callable

from backfill.jobs.execution.claims import ClaimedRequest, claim_requests
from backfill.storage.db import unit_of_work
from backfill.storage.objects import ObjectStore

MAX_SPAN_READ = 8 * 1024 * 1024


def claim_lines(
    planner: Callable[[int], list[tuple[str, int]]],
    n: int,
    *,
    holder: str,
    kv_budget_tokens: int | None,
) -> list[ClaimedRequest]:
    """Claim up to `n` lines for `holder`, batch by batch in the planner's order."""
    # The plan may list more than n (a tail in priority order): a batch whose lines are all
    # running or backing off yields fewer than planned, and the next one fills in.
    out: list[ClaimedRequest] = []
    for batch_id, k in planner(n):
        want = min(k, n - len(out))
        if want <= 0:
            break
        with unit_of_work() as session:
            out += claim_requests(
                session,
                batch_id=batch_id,
                limit=want,
                claim_token=holder,
                kv_budget_tokens=kv_budget_tokens,
            )
    return out


def read_bodies(store: ObjectStore, claimed: list[ClaimedRequest]) -> dict[tuple[str, int], bytes]:
    """Read claimed lines from their input files, one ranged read per contiguous stretch.
    Keyed by (batch, line): a claim group may span batches, whose line numbers repeat."""
    out: dict[tuple[str, int], bytes] = {}
    by_key: dict[str, list[ClaimedRequest]] = {}
    for r in claimed:
        by_key.setdefault(r.input_key, []).append(r)
    for key, reqs in by_key.items():
        reqs.sort(key=lambda r: r.offset)
        start = reqs[0].offset
        end = max(r.offset + r.length for r in reqs)
        if end - start <= MAX_SPAN_READ:
            blob = store.read_range(key, start, end - start)
            for r in reqs:
                out[(r.batch_id, r.line)] = blob[r.offset - start : r.offset - start + r.length]
        else:
            for r in reqs:
                out[(r.batch_id, r.line)] = store.read_range(key, r.offset, r.length)
    return out
