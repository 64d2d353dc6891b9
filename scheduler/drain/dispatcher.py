"""The drain loop: lease capacity, claim lines, send them to the fleet, record results.

The stages live beside it: admission (`scheduler.capacity.admission`), the claim and the bodies' reads
(`scheduler.drain.dispatcher`), the fleet call (`scheduler.fleet.n_expansion`, `scheduler.fleet.client`), aborting
calls when the controller sheds (`scheduler.drain.shedding`) and recording (`scheduler.drain.recorder`).
A reply is parsed once, as it arrives, into the `Answer` the drain observes and the recorder stores.

One asyncio loop per drain task keeps many requests in flight without one broker message
per request. Results are committed in small groups; a claim whose holder dies is reclaimed
by the scheduler after its heartbeat lapses, so nothing is lost and nothing is written twice.

Faults a drain rides out rather than dies of:
- SIGTERM (`shutdown` set): it stops claiming at once, lets in-flight requests finish for the
  grace period, then aborts the rest and gives their lines back without spending an attempt.
- The database unreachable: the replies in hand wait in the recorder's bounded buffer while it
  retries with backoff (up to `db_patience_s`); meanwhile nothing new is claimed or sent.
- Redis unreachable or restarted empty: no new leases (so nothing new is sent), in-flight
  requests finish and are recorded; the keepalive re-asserts the heartbeat and leases.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import orjson
from redis.exceptions import RedisError

from backfill.jobs.errors import error_bytes
from backfill.jobs.execution.claims import ClaimedRequest
from backfill.scheduler.capacity.admission import Admission, KvBudget, LeaseReturns, Observation, pool_of
from backfill.scheduler.drain.claiming import BodyReader, claim_lines
from backfill.scheduler.drain.escalation import EscalatedRelease, overflow_request_id
from backfill.scheduler.drain.recorder import Answer, Done, Recorder
from backfill.scheduler.drain.shedding import InflightCalls
from backfill.scheduler.fleet.breaker import BreakerState
from backfill.scheduler.fleet.client import FleetClient, FleetReply, add_routing_hints
from backfill.scheduler.fleet.n_expansion import post_request
from backfill.scheduler.fleet.routing import FleetRoutes, Pool
from backfill.scheduler.metrics import record_fleet_reply
from backfill.storage.db import is_transient
from backfill.storage.leases import DRAIN_POOL, LeaseStore
from backfill.storage.objects import ObjectStore

log = logging.getLogger("backfill.dispatch")

CLAIM_GROUP = 32
# How long a drain waits for a drain slot, and how often it asks (`Dispatcher.run`).
SLOT_WAIT_S, SLOT_POLL_S = 1.0, 0.05
# How long a drain with nothing to do stays, and how often it looks for work meanwhile (`Dispatcher._idle`).
IDLE_LINGER_S, IDLE_POLL_S = 2.0, 0.05

UNSHEDDABLE = -1  # the shedding key of escalated calls: no controller's shed target aborts them


class Dispatcher:
    def __init__(
        self,
        *,
        store: ObjectStore,
        leases: LeaseStore,
        admission: Admission,
        fleet: FleetClient,
        # planner(n) plans n releases; a planner that also takes `models=` plans among those
        # models' batches (`scheduler.runtime.Planner`), which routing by model needs.
        planner: Callable[..., list[tuple[str, int]]],
        max_attempts: int,
        hint_mode: str = "nvext",
        shutdown: threading.Event | None = None,
        grace_s: float = 20.0,
        db_patience_s: float = 120.0,
        kv_budget_tokens: int | None = None,
        kv_by_model: bool = False,
        expand_n: bool | None = None,
        escalation: EscalatedRelease | None = None,
        routes: FleetRoutes | None = None,
        pending_models: Callable[[], set[str | None]] | None = None,
        on_all_recorded: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self._bodies = BodyReader(store)  # the claimed lines' bodies, read ahead
        self.leases = leases
        self.admission = admission
        self.fleet = fleet
        self.planner = planner
        self.max_attempts = max_attempts
        self.hint_mode = hint_mode
        # Prefix-aware release (jobs.execution.claims): the fleet's KV tokens open to batch work, and
        # whether n > 1 goes as n requests (True), whole (False) or whole and completed (None).
        self.kv_budget_tokens = kv_budget_tokens
        # With `kv_by_model`, a model's claims read its own pools' budget (`Admission.kv_budget`),
        # once per drain as the fleet's: a model's controller's where it publishes one.
        self.kv_by_model = kv_by_model
        self._kv_budgets: dict[frozenset[str], KvBudget | None] = {}
        self.expand_n = expand_n
        self.escalation = escalation  # escalated lines: beyond the limit, or to overflow
        # Which deployments serve which model (None: every one serves all), and the models with
        # work left: leases are taken only in the pools of those models, on deployments serving them.
        self.routes = routes or FleetRoutes([])
        self.pending_models = pending_models or (lambda: {None})
        self.shutdown = shutdown or threading.Event()
        self.grace_s = grace_s
        self.db_patience_s = db_patience_s
        self.holder = f"drain-{uuid.uuid4().hex[:12]}"
        self._held: dict[str, str] = {}  # lease id -> its pool, for renewal
        self.recorder = Recorder(
            holder=self.holder,
            max_attempts=max_attempts,
            patience_s=db_patience_s,
            finish_by=self._finish_by,
            on_all_recorded=on_all_recorded,  # finalization nudged as a batch's last line is recorded
        )
        self._inflight: set[asyncio.Task[None]] = set()
        self._calls = InflightCalls(admission, leases, self._lease_store_down)  # what a shed may abort
        self._returns = LeaseReturns(admission, self._lease_store_down)  # freed leases, given back in groups
        self._on: Counter[Pool] = Counter()  # this drain's lines in hand, per pool
        self._models: set[str | None] = {None}  # the models with work left, as last planned
        self._stop_seen_at: float | None = None
        self._idle_since: float | None = None  # since when nothing was claimed or in flight
        self._leases_down_since: float | None = None
        self._claim_in_doubt = False  # a claim failed on the connection: it may have committed
        self._abort_all = False
        self.sent = 0
        self.aborted = 0

    # -- shutdown ---------------------------------------------------------------------------

    def _stopping(self) -> bool:
        if self._stop_seen_at is None and self.shutdown.is_set():
            self._stop_seen_at = time.monotonic()
            log.info(
                "drain %s: shutting down: claiming stopped; %d requests in flight get %.0f s to finish",
                self.holder,
                len(self._inflight),
                self.grace_s,
            )
        return self._stop_seen_at is not None

    def _finish_by(self) -> float | None:
        """When a stopping drain must be done (recorded what it has and given back the rest)."""
        self._stopping()
        return None if self._stop_seen_at is None else self._stop_seen_at + self.grace_s

    # -- the loop -----------------------------------------------------------------------------

    async def run(self, slice_s: float, *, max_drains: int) -> int:
        """Work for about `slice_s` seconds (or until no work is left); returns requests sent.

        A drain first takes one of `max_drains` slots, waiting up to SLOT_WAIT_S for one, so
        surplus nudges end soon. (A drain started for new work may find every slot held by
        drains that are about to end for lack of work, or that see the new work themselves
        within a planner refresh: waiting briefly covers the first case.)"""
        if self._stopping():
            return 0
        give_up_at = time.monotonic() + SLOT_WAIT_S
        try:
            while not (
                slot := await asyncio.to_thread(
                    self.leases.acquire, DRAIN_POOL, limit=max_drains, n=1, ttl_s=self.admission.ttl_s
                )
            ):
                if time.monotonic() >= give_up_at or self._stopping():
                    return 0
                await asyncio.sleep(SLOT_POLL_S)
            await asyncio.to_thread(self.leases.heartbeat, self.holder, ttl_s=self.admission.ttl_s)
        except RedisError:
            log.warning("lease store unreachable: drain not started", exc_info=True)
            return 0
        self._held[slot[0]] = DRAIN_POOL
        keepalive = asyncio.create_task(self._keepalive())
        writer = asyncio.create_task(self.recorder.run())
        watcher = asyncio.create_task(self._calls.watch())
        slot_held = True
        try:
            try:
                await self._release_loop(time.monotonic() + slice_s)
                # Claiming is over: the slot goes now, not after the last reply (a long request can
                # take minutes), so the scheduler starts a drain for work that arrives meanwhile. The
                # requests still in flight hold their capacity leases, which is what bounds the fleet.
                slot_held = not await self._release_slot(slot)
            finally:
                # Whatever ended the loop, even an error it could not handle, the requests already
                # sent are answered and recorded first: the lines still held afterwards are given
                # back as never sent, which a line whose request is out must not be.
                await self._finish_inflight()
        finally:
            watcher.cancel()
            await self._returns.flush()
            await self.recorder.queue.put(None)
            await writer
            await self.recorder.give_back_unsent(in_doubt=self._claim_in_doubt)
            keepalive.cancel()
            try:
                await asyncio.to_thread(self.admission.flush_observations, 0.0)
            except RedisError:
                log.warning("could not flush the observations", exc_info=True)
            if slot_held:
                await self._release_slot(slot)
        if self._stop_seen_at is not None:
            log.info(
                "drain %s: stopped %.1f s after the shutdown signal (%d aborted and requeued)",
                self.holder,
                time.monotonic() - self._stop_seen_at,
                self.aborted,
            )
        return self.sent

    async def _release_slot(self, slot: list[str]) -> bool:
        try:
            await asyncio.to_thread(self.leases.release, DRAIN_POOL, slot)
        except RedisError:
            log.warning("could not release the drain slot; it lapses by itself", exc_info=True)
            return False
        self._held.pop(slot[0], None)
        return True

    async def _idle(self) -> bool:
        """A round that claimed nothing: True (the drain ends) once it has had nothing claimed
        and nothing in flight for IDLE_LINGER_S, else after a moment to look again.

        An idle drain lingers, looking often, because the next small batch usually follows soon
        (an RL submitter's next rollout, an eval sweep's next step): it is released at once by a
        drain already running, not after another drain's start. Each look is one read of the
        batches with work left (the planner looks again rather than at its cached view)."""
        if (look_again := getattr(self.planner, "look_again", None)) is not None:
            look_again()
        if self._inflight:
            # One finishing may free lines that wait for it (an agent trace's next turn, KV budget).
            self._idle_since = None
            await asyncio.sleep(0.1)
            return False
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since >= IDLE_LINGER_S:
            return True  # the scheduler, or the next batch's validation, starts another drain
        await asyncio.sleep(IDLE_POLL_S)
        return False

    async def _release_loop(self, deadline: float) -> None:
        while time.monotonic() < deadline and not self._stopping():
            if not self.recorder.db_ok.is_set():
                await self.recorder.wait_for_db(until=lambda: time.monotonic() >= deadline or self._stopping())
                continue
            try:
                # Which deployments serve which model, known before any lease is taken: a drain's
                # first round must not take a deployment it has not asked yet for one serving all.
                await asyncio.to_thread(self.routes.refresh)
                self._models = await asyncio.to_thread(self.pending_models)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.recorder.unreachable(exc)
                continue
            if self.escalation is not None:
                await self._release_escalated()
            if not self._models:  # no batch has work: as a claim that found none
                if await self._idle():
                    return
                continue
            try:
                leases = await self.admission.acquire_spread(
                    CLAIM_GROUP, wait_s=0.5, cancel=self._stopping, room=self._room
                )
                self._lease_store_up()
            except RedisError:
                self._lease_store_down("taking leases")
                await asyncio.sleep(0.5)
                continue
            if not leases:
                continue
            try:
                # A snapshot: the recorder's set changes on this loop while the claim runs on a thread.
                answered = frozenset(self.recorder.answered)
                claimed, leases, spare = await asyncio.to_thread(self._claim, leases, answered)
            except RedisError:  # the planner reads the published rate
                await self._give_back(leases)
                self._lease_store_down("planning")
                await asyncio.sleep(0.5)
                continue
            except Exception as exc:
                await self._give_back(leases)
                if not is_transient(exc):
                    raise
                self._claim_in_doubt = True
                self.recorder.unreachable(exc)
                continue
            if not claimed:
                await self._give_back(spare)
                if await self._idle():
                    return
                continue
            self._idle_since = None
            await self._give_back(spare)
            if not await self._launch(claimed, leases):
                await asyncio.sleep(1.0)

    def _claim(
        self, leases: list[tuple[str, Pool]], answered: frozenset[tuple[str, int]] = frozenset()
    ) -> tuple[list[ClaimedRequest], list[tuple[str, Pool]], list[tuple[str, Pool]]]:
        """Claim lines for the leases, pool by pool: a pool's leases carry only lines of the
        models it serves, planned on those models' fair share. Returns the lines, the leases
        they take (in the same order) and the leases left over."""
        groups: dict[frozenset[str] | None, list[tuple[str, Pool]]] = {}
        for lease in leases:
            groups.setdefault(self.routes.claimable(lease[1]), []).append(lease)
        claimed: list[ClaimedRequest] = []
        used: list[tuple[str, Pool]] = []
        spare: list[tuple[str, Pool]] = []
        for models, group in groups.items():
            planner = self.planner if models is None else functools.partial(self.planner, models=models)
            budget = self._kv_budget(models)
            got = claim_lines(
                planner,
                len(group),
                holder=self.holder,
                kv_budget_tokens=budget.tokens if budget is not None else None,
                answered=answered,
                kv_models=budget.models if budget is not None else None,
            )
            claimed += got
            used += group[: len(got)]
            spare += group[len(got) :]
        return claimed, used, spare

    def _kv_budget(self, models: frozenset[str] | None) -> KvBudget | None:
        """The KV budget the claims of `models`' lines size prefix groups by: their pools' own
        (`kv_by_model`), else the fleet's, which every model's lines in flight hold."""
        if not self.kv_by_model or models is None:
            return KvBudget(self.kv_budget_tokens, None) if self.kv_budget_tokens is not None else None
        if models not in self._kv_budgets:
            pools = self.routes.pools(range(self.admission.deployments), set(models))
            self._kv_budgets[models] = self.admission.kv_budget(pools, self.routes.models_of)
        return self._kv_budgets[models]

    async def _launch(
        self, claimed: list[ClaimedRequest], leases: list[tuple[str, Pool]], *, escalated: bool = False
    ) -> bool:
        """Read the claimed lines' bodies and send each under its lease; False (the lines
        requeued, their leases given back) when the object store failed the read."""
        try:
            bodies = await asyncio.to_thread(self._bodies.read, claimed)
        except Exception:
            log.exception("reading %d claimed lines from the object store failed; requeued", len(claimed))
            await self._give_back(leases[: len(claimed)])
            for request in claimed:
                await self.recorder.put(Done(request, None))
            return False
        for request, (lease, pool) in zip(claimed, leases, strict=False):
            self._held[lease] = pool_of(pool)
            self._on[pool] += 1
            task = asyncio.create_task(
                self._send(request, lease, pool, bodies[(request.batch_id, request.line)], escalated=escalated)
            )
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        return True

    async def _release_escalated(self) -> None:
        """Escalated batches' lines (`scheduler.drain.escalation`): beyond the limit, or on overflow."""
        assert self.escalation is not None
        try:
            states = await self.fleet.states()
        except (RedisError, OSError):
            return  # the breakers cannot be read: escalated lines wait for the next round
        try:
            taken = await self.escalation.take(
                CLAIM_GROUP,
                holder=self.holder,
                states=states,
                held=dict(self._on),
                routes=self.routes,
                circuits=self.fleet.pool_states,
            )
        except RedisError:
            self._lease_store_down("taking escalated leases")
            return
        except Exception as exc:
            if not is_transient(exc):
                raise
            self._claim_in_doubt = True
            self.recorder.unreachable(exc)
            return
        if taken:
            await self._launch([r for r, _, _ in taken], [(lease, pool) for _, lease, pool in taken], escalated=True)

    async def _finish_inflight(self) -> None:
        """Wait for the requests in flight; once stopping, only until shortly before the grace
        ends, then abort the rest (their lines go back to pending, no attempt spent)."""
        while self._inflight:
            finish_by = self._finish_by() if self._stopping() else None
            if finish_by is not None and time.monotonic() >= finish_by - min(2.0, self.grace_s / 4):
                self._abort_all = True
                self._calls.abort_all()
                await asyncio.gather(*self._inflight, return_exceptions=True)
                return
            await asyncio.wait(self._inflight, timeout=0.1)

    async def _give_back(self, leases: list[tuple[str, Pool]]) -> None:
        for lease, pool in leases:
            self._returns.add(lease, pool)

    async def _room(self, n: int) -> dict[Pool, int]:
        """Leases each pool may give this drain now: the pools of the fleet's deployments for the
        models with work left, on the deployments serving them (a model without work takes none,
        so the claims never wait on it): all it wants while its circuit is closed; else one (to
        wait for the probe with) unless it has a line there already."""
        pools = self.routes.pools(range(self.admission.deployments), self._models)
        try:
            states = await self.fleet.pool_states(pools)  # a model's pool has a circuit of its own
        except (RedisError, OSError):  # Redis away: the breakers decide locally when a line is sent
            states = dict.fromkeys(pools, BreakerState.closed)
        return {p: n if states[p] is BreakerState.closed else (0 if self._on[p] else 1) for p in pools}

    def _lease_store_down(self, what: str) -> None:  # logs an outage's first failure only
        if self._leases_down_since is None:
            self._leases_down_since = time.monotonic()
            log.warning("lease store unreachable (%s): nothing new is sent until it is back", what, exc_info=True)

    def _lease_store_up(self) -> None:
        if self._leases_down_since is not None:
            log.info("lease store reachable again after %.1f s", time.monotonic() - self._leases_down_since)
            self._leases_down_since = None

    async def _send(
        self, request: ClaimedRequest, lease: str, pool: Pool, raw: bytes, *, escalated: bool = False
    ) -> None:
        deployment = pool.deployment
        answer: Answer | None = None  # None: aborted, the line goes back to pending
        call: asyncio.Task[FleetReply] | None = None
        try:
            if self._abort_all:  # past the shutdown grace before it was sent: requeued unsent
                self.aborted += 1
            else:
                body = orjson.loads(raw)["body"]
                # Only the fleet call itself can be shed; recording the outcome always runs.
                body = add_routing_hints(body, self.hint_mode)
                call = asyncio.create_task(
                    post_request(self.fleet, request.endpoint, body, expand_n=self.expand_n, deployment=deployment)
                )
                self._calls.add(call, UNSHEDDABLE if escalated else pool)
                reply = await call
                self.sent += 1
                answer = Answer.of(reply)  # parsed here, once: observed now, recorded as it is
                if deployment >= self.admission.deployments:  # the output shows where it ran
                    answer = replace(
                        answer,
                        outcome=replace(answer.outcome, request_id=overflow_request_id(answer.outcome.request_id)),
                        # Any refusal from an overflow is the provider's (its keys, its model list,
                        # its rate limit, its servers), not the line's, which would have run on the
                        # fleet: the line goes back to the fleet paths without spending an attempt,
                        # and the overflow's breaker counts it (`FleetClient._report`).
                        transient=answer.transient or not answer.outcome.succeeded,
                        sent=answer.sent and answer.outcome.succeeded,
                    )
                self._observe(reply, answer, pool)
                record_fleet_reply(reply)
        except asyncio.CancelledError:
            if call is None or not call.cancelled():
                raise
            # Shed by the capacity controller, or past the shutdown grace: closing the connection
            # makes the fleet drop the request and free its KV cache; the line goes back to pending.
            answer = None
            self.aborted += 1
        except Exception as exc:
            log.exception("sending line %s of batch %s failed", request.line, request.batch_id)
            answer = Answer.of(FleetReply(500, error_bytes(repr(exc), type_="server_error"), None, 0.0, transient=True))
        finally:
            if call is not None:
                self._calls.discard(call)
            self._held.pop(lease, None)
            self._on[pool] -= 1
            self._returns.add(lease, pool)
        await self.recorder.put(Done(request, answer))

    def _observe(self, reply: FleetReply, answer: Answer, pool: Pool) -> None:
        if pool.deployment >= self.admission.deployments:
            return  # an overflow deployment: no controller steers it, its breaker guards it
        usage = answer.outcome.usage if reply.status_code == 200 else None
        self.admission.observe(
            Observation(
                reply.status_code,
                reply.latency_s,
                reply.transient,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                completion_tokens=usage.completion_tokens if usage else 0,
            ),
            pool,
        )

    async def _keepalive(self) -> None:
        period = self.admission.ttl_s / 3
        while True:
            await asyncio.sleep(period)
            try:
                # Both are upserts while the store recovers from a loss of its data: a Redis that
                # restarted empty gets this drain's heartbeat and leases back within a period.
                await asyncio.to_thread(self.leases.heartbeat, self.holder, ttl_s=self.admission.ttl_s)
                for pool in {DRAIN_POOL, *self._held.values()}:
                    ids = [lease for lease, p in self._held.items() if p == pool]
                    await asyncio.to_thread(self.leases.renew, pool, ids, ttl_s=self.admission.ttl_s)
            except RedisError:
                self._lease_store_down("heartbeat")
            except Exception:
                log.warning("heartbeat failed", exc_info=True)
