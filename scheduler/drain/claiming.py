"""A drain's claim stage: take the lines the planner releases, and read their bodies.

The claim itself is a compare-and-set in the database (`jobs.execution.claims`); the bodies stay in the
batch's input file in the object store, read back by ranges.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

from backfill.jobs.execution.claims import ClaimedRequest, claim_requests
from backfill.storage.db import unit_of_work
from backfill.storage.objects import ObjectStore

MAX_SPAN_READ = 8 * 1024 * 1024
READ_AHEAD = 1024 * 1024  # bytes a drain reads of an input file at least, for the claims to come
KEPT_WINDOWS = 4  # input files whose last read a drain keeps


def claim_lines(
    planner: Callable[[int], list[tuple[str, int]]],
    n: int,
    *,
    holder: str,
    kv_budget_tokens: int | None,
    answered: Collection[tuple[str, int]] = frozenset(),
    kv_models: Collection[str] | None = None,
) -> list[ClaimedRequest]:
    """Claim up to `n` lines for `holder`, batch by batch in the planner's order. `answered`: the
    holder's lines whose replies are in but not yet recorded (they hold no KV any more);
    `kv_models`: the models whose lines in flight hold the KV budget (None: every model's)."""
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
                answered=answered,
                kv_models=kv_models,
            )
    return out


class BodyReader:
    """Reads claimed lines from their input files, one ranged read per contiguous stretch, and
    reads ahead: a stretch read goes on to READ_AHEAD bytes, kept (the last window of each of
    up to KEPT_WINDOWS files) for the next claims, whose lines usually follow. A claim of a few
    lines cost a ranged read of its own (a GET through boto3: more CPU than the lines' claim);
    input files never change, so what is kept never goes stale. One per drain (not thread-safe:
    the drain reads from one thread at a time)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._windows: OrderedDict[str, tuple[int, bytes]] = OrderedDict()  # key -> (start, bytes)
        self.reads = 0

    def read(self, claimed: list[ClaimedRequest]) -> dict[tuple[str, int], bytes]:
        """Keyed by (batch, line): a claim group may span batches, whose line numbers repeat."""
        out: dict[tuple[str, int], bytes] = {}
        by_key: dict[str, list[ClaimedRequest]] = {}
        for r in claimed:
            by_key.setdefault(r.input_key, []).append(r)
        for key, reqs in by_key.items():
            start = min(r.offset for r in reqs)
            end = max(r.offset + r.length for r in reqs)
            window = self._window(key, start, end)
            if window is not None:
                at, blob = window
                for r in reqs:
                    out[(r.batch_id, r.line)] = blob[r.offset - at : r.offset - at + r.length]
            else:  # lines too far apart for one read: each its own
                for r in reqs:
                    self.reads += 1
                    out[(r.batch_id, r.line)] = self.store.read_range(key, r.offset, r.length)
        return out

    def _window(self, key: str, start: int, end: int) -> tuple[int, bytes] | None:
        """Bytes of `key` from at most `start` through at least `end`: kept, or read now."""
        kept = self._windows.get(key)
        if kept is not None and kept[0] <= start and end <= kept[0] + len(kept[1]):
            self._windows.move_to_end(key)
            return kept
        if end - start > MAX_SPAN_READ:
            return None
        self.reads += 1
        # Past the file's end a ranged read returns what there is; the lines asked for are there.
        blob = self.store.read_range(key, start, max(end - start, READ_AHEAD))
        if len(blob) < end - start:
            raise OSError(f"{key}: {len(blob)} bytes from {start}, {end - start} expected")
        self._windows[key] = (start, blob)
        self._windows.move_to_end(key)
        while len(self._windows) > KEPT_WINDOWS:
            self._windows.popitem(last=False)
        return start, blob
