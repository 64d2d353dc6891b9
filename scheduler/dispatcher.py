"""The drain loop: lease capacity, claim lines, send them to the fleet, record results.

One asyncio loop per drain task keeps many requests in flight without one broker message
per request. Results are committed in small groups; a claim whose holder dies is reclaimed
by the scheduler after its heartbeat lapses, so nothing is lost and nothing is written twice.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import orjson
from sqlalchemy.exc import OperationalError

from jobs.claims import ClaimedRequest, claim_requests, release_for_retry, requeue_unstarted
from jobs.models import utcnow
from jobs.replies import Outcome, normalise_body, usage_from_body
from jobs.results import record_outcomes
from scheduler.admission import POOL, Admission, Observation
from scheduler.capacity import shed_count
from scheduler.fleet import FleetClient, FleetReply
from scheduler.leases import LeaseStore
from storage.db import unit_of_work
from storage.objects import ObjectStore

log = logging.getLogger("backfill.dispatch")

CLAIM_GROUP = 32
DRAIN_POOL = "drains"
MAX_SPAN_READ = 8 * 1024 * 1024
BACKOFF_BASE_S, BACKOFF_CAP_S = 1.0, 60.0


@dataclass
class _Done:
    request: ClaimedRequest
    reply: FleetReply | None  # None: aborted to give capacity back; requeued, no attempt spent


# Routing hints backfill may add to a body (nothing else of the client's body is touched).
def add_routing_hints(body: dict[str, Any], mode: str) -> dict[str, Any]:
    if mode == "nvext":
        nvext = dict(body.get("nvext") or {})
        hints = dict(nvext.get("agent_hints") or {})
        hints.setdefault("priority", -10)
        nvext["agent_hints"] = hints
        return {**body, "nvext": nvext}
    if mode == "vllm":
        return {**body, "priority": body.get("priority", 10)}  # vLLM: larger value = served later
    return body


class Dispatcher:
    def __init__(
        self,
        *,
        store: ObjectStore,
        leases: LeaseStore,
        admission: Admission,
        fleet: FleetClient,
        planner: Callable[[int], list[tuple[str, int]]],
        max_attempts: int,
        hint_mode: str = "nvext",
    ) -> None:
        self.store = store
        self.leases = leases
        self.admission = admission
        self.fleet = fleet
        self.planner = planner
        self.max_attempts = max_attempts
        self.hint_mode = hint_mode
        self.holder = f"drain-{uuid.uuid4().hex[:12]}"
        self._held: dict[str, str] = {}  # lease id -> its pool, for renewal
        self._results: asyncio.Queue[_Done | None] = asyncio.Queue()
        self._inflight: set[asyncio.Task[None]] = set()
        self._calls: dict[asyncio.Task[FleetReply], float] = {}  # in-flight fleet calls, by start time
        self.sent = 0
        self.aborted = 0

    async def run(self, slice_s: float, *, max_drains: int) -> int:
        """Work for about `slice_s` seconds (or until no work is left); returns requests sent.

        A drain first takes one of `max_drains` slots, so surplus nudges end at once."""
        slot = await asyncio.to_thread(
            self.leases.acquire, DRAIN_POOL, limit=max_drains, n=1, ttl_s=self.admission.ttl_s
        )
        if not slot:
            return 0
        self._held[slot[0]] = DRAIN_POOL
        await asyncio.to_thread(self.leases.heartbeat, self.holder, ttl_s=self.admission.ttl_s)
        keepalive = asyncio.create_task(self._keepalive())
        writer = asyncio.create_task(self._write_results())
        watcher = asyncio.create_task(self._watch_shed())
        try:
            await self._release_loop(time.monotonic() + slice_s)
            if self._inflight:
                await asyncio.gather(*self._inflight, return_exceptions=True)
        finally:
            watcher.cancel()
            await self._results.put(None)
            await writer
            keepalive.cancel()
            await asyncio.to_thread(self.admission.flush_observations, 0.0)
            await asyncio.to_thread(self.leases.release, DRAIN_POOL, slot)
        return self.sent

    async def _release_loop(self, deadline: float) -> None:
        idle_rounds = 0
        while time.monotonic() < deadline:
            leases = await self.admission.acquire(CLAIM_GROUP, wait_s=0.5)
            if not leases:
                continue
            claimed = await asyncio.to_thread(self._claim, len(leases))
            if not claimed:
                await self.admission.release(leases)
                idle_rounds += 1
                if idle_rounds >= 3 and not self._inflight:
                    return  # nothing to do: the scheduler starts another drain when work arrives
                await asyncio.sleep(min(0.1 * idle_rounds, 1.0))
                continue
            idle_rounds = 0
            spare = leases[len(claimed) :]
            if spare:
                await self.admission.release(spare)
            bodies = await asyncio.to_thread(self._load_bodies, claimed)
            for request, lease in zip(claimed, leases, strict=False):
                self._held[lease] = POOL
                task = asyncio.create_task(self._send(request, lease, bodies[request.line]))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)

    async def _watch_shed(self, every_s: float = 0.1) -> None:
        """Abort this drain's share of in-flight requests above the controller's shed target,
        youngest first (they have the least work to lose), and pass observations on."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await asyncio.to_thread(self.admission.flush_observations)
                target = await asyncio.to_thread(self.admission.shed_target)
                if target is None or not self._calls:
                    continue
                total = await asyncio.to_thread(self.leases.count, POOL)
                k = shed_count(total, target, len(self._calls))
                if k:
                    youngest = sorted(self._calls, key=self._calls.__getitem__, reverse=True)[:k]
                    for call in youngest:
                        self._calls.pop(call, None)  # counted once, even if the abort is slow
                        call.cancel()
                    log.info("shed %d in-flight requests (fleet %d > target %d)", k, total, target)
            except Exception:
                log.warning("shed check failed", exc_info=True)

    def _claim(self, n: int) -> list[ClaimedRequest]:
        # The plan may list more than n (a tail in priority order): a batch whose lines are all
        # running or backing off yields fewer than planned, and the next one fills in.
        out: list[ClaimedRequest] = []
        for batch_id, k in self.planner(n):
            want = min(k, n - len(out))
            if want <= 0:
                break
            with unit_of_work() as session:
                out += claim_requests(session, batch_id=batch_id, limit=want, claim_token=self.holder)
        return out

    def _load_bodies(self, claimed: list[ClaimedRequest]) -> dict[int, bytes]:
        """Read claimed lines from the input file, one ranged read per contiguous stretch."""
        out: dict[int, bytes] = {}
        by_key: dict[str, list[ClaimedRequest]] = {}
        for r in claimed:
            by_key.setdefault(r.input_key, []).append(r)
        for key, reqs in by_key.items():
            reqs.sort(key=lambda r: r.offset)
            start = reqs[0].offset
            end = max(r.offset + r.length for r in reqs)
            if end - start <= MAX_SPAN_READ:
                blob = self.store.read_range(key, start, end - start)
                for r in reqs:
                    out[r.line] = blob[r.offset - start : r.offset - start + r.length]
            else:
                for r in reqs:
                    out[r.line] = self.store.read_range(key, r.offset, r.length)
        return out

    async def _send(self, request: ClaimedRequest, lease: str, raw: bytes) -> None:
        reply: FleetReply | None
        call: asyncio.Task[FleetReply] | None = None
        try:
            body = orjson.loads(raw)["body"]
            # Only the fleet call itself can be shed; recording the outcome always runs.
            call = asyncio.create_task(self.fleet.post(request.endpoint, add_routing_hints(body, self.hint_mode)))
            self._calls[call] = time.monotonic()
            reply = await call
            self.sent += 1
            usage = (
                usage_from_body(normalise_body(reply.body)[1]) if reply.status_code == 200 else None
            )
            self.admission.observe(
                Observation(
                    reply.status_code,
                    reply.latency_s,
                    reply.transient,
                    prompt_tokens=usage.prompt_tokens if usage else 0,
                    completion_tokens=usage.completion_tokens if usage else 0,
                )
            )
        except asyncio.CancelledError:
            if call is None or not call.cancelled():
                raise
            # Shed by the capacity controller: closing the connection makes the fleet drop the
            # request and free its KV cache; the line goes back to pending.
            reply = None
            self.aborted += 1
        except Exception as exc:
            log.exception("sending line %s of batch %s failed", request.line, request.batch_id)
            reply = FleetReply(500, orjson.dumps({"error": {"message": repr(exc)}}), None, 0.0, transient=True)
        finally:
            if call is not None:
                self._calls.pop(call, None)
            self._held.pop(lease, None)
            await self.admission.release([lease])
        await self._results.put(_Done(request, reply))

    async def _write_results(self) -> None:
        """Commit results in small groups: one transaction per group, not per line."""
        while True:
            item = await self._results.get()
            group = [item] if item is not None else []
            stop = item is None
            while not stop and not self._results.empty() and len(group) < 200:
                nxt = self._results.get_nowait()
                if nxt is None:
                    stop = True
                else:
                    group.append(nxt)
            if group:
                await asyncio.to_thread(self._commit_with_retry, group)
            if stop:
                return

    def _commit_with_retry(self, group: list[_Done]) -> None:
        # Sorted, so concurrent drains lock batch rows in one order; a deadlock with a sweep
        # (expiry, cancellation) aborts one side, and the whole group is simply tried again.
        group.sort(key=lambda d: (d.request.batch_id, d.request.line))
        for attempt in range(5):
            try:
                self._commit(group)
                return
            except OperationalError:
                if attempt == 4:
                    raise
                log.warning("result commit conflicted; retrying", exc_info=True)
                time.sleep(0.05 * (attempt + 1))

    def _commit(self, group: list[_Done]) -> None:
        finished: list[tuple[str, int, Outcome]] = []
        with unit_of_work() as session:
            for done in group:
                r, reply = done.request, done.reply
                if reply is None:
                    requeue_unstarted(session, batch_id=r.batch_id, lines=[r.line], claim_token=self.holder)
                    continue
                if reply.transient and r.attempts + 1 < self.max_attempts:
                    delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**r.attempts) * random.uniform(0.5, 1.0)
                    release_for_retry(
                        session,
                        batch_id=r.batch_id,
                        line=r.line,
                        claim_token=self.holder,
                        not_before=utcnow() + timedelta(seconds=delay),
                    )
                    continue
                body, parsed = normalise_body(reply.body)
                outcome = Outcome(
                    status_code=reply.status_code,
                    body=body,
                    request_id=reply.request_id or (parsed.get("id") if isinstance(parsed, dict) else None),
                    usage=usage_from_body(parsed),
                )
                finished.append((r.batch_id, r.line, outcome))
            record_outcomes(session, claim_token=self.holder, results=finished)

    async def _keepalive(self) -> None:
        period = self.admission.ttl_s / 3
        while True:
            await asyncio.sleep(period)
            try:
                await asyncio.to_thread(self.leases.heartbeat, self.holder, ttl_s=self.admission.ttl_s)
                for pool in (POOL, DRAIN_POOL):
                    ids = [lease for lease, p in self._held.items() if p == pool]
                    await asyncio.to_thread(self.leases.renew, pool, ids, ttl_s=self.admission.ttl_s)
            except Exception:
                log.warning("heartbeat failed", exc_info=True)
