"""The scheduler's metrics: what drains send to the fleet and how long it takes, what the capacity
controller decides, how long validation and finalization run.

Written by the worker's pool children and the scheduler process into the shared metrics
directory (`storage.metrics`); the API's `/metrics` adds them up. Every call here is cheap (an
mmap write) and never raises into the work it measures.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, ParamSpec, TypeVar

from prometheus_client import Counter, Gauge, Histogram

from backfill.scheduler.capacity.law import Decision
from backfill.scheduler.fleet.client import FleetReply
from backfill.storage.metrics import counter, histogram, latest_gauge

log = logging.getLogger("backfill.metrics")

P = ParamSpec("P")
R = TypeVar("R")

# A batch request's whole reply (not streamed): from a fraction of a second to minutes.
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
# The controller's smoothed interactive latency, finest around the usual SLOs (50 ms ITL, 1 s TTFT).
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)
TASK_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)


@dataclass(frozen=True)
class SchedulerMetrics:
    dispatched: Counter
    fleet_latency: Histogram
    itl: Histogram
    ttft: Histogram
    decisions: Counter
    lease_limit: Gauge
    leases_in_use: Gauge
    interactive: Gauge
    decided_at: Gauge
    validation: Histogram
    finalization: Histogram


@lru_cache
def scheduler_metrics() -> SchedulerMetrics:
    return SchedulerMetrics(
        dispatched=counter(
            "backfill_dispatched_requests",
            "Batch requests the drains sent to the fleet, by the fleet's HTTP status ('unsent': no deployment took it).",
            ("code",),
        ),
        fleet_latency=histogram(
            "backfill_fleet_request_duration_seconds",
            "Time from sending a batch request to the fleet to its whole reply, as a drain saw it.",
            REQUEST_BUCKETS,
        ),
        itl=histogram(
            "backfill_fleet_itl_seconds",
            "The fleet's smoothed inter-token latency, as the capacity controller saw it each period.",
            ITL_BUCKETS,
        ),
        ttft=histogram(
            "backfill_fleet_ttft_seconds",
            "The fleet's smoothed time to first token, as the capacity controller saw it each period.",
            TTFT_BUCKETS,
        ),
        decisions=counter(
            "backfill_capacity_decisions", "Capacity controller periods, by what it decided.", ("reason",)
        ),
        lease_limit=latest_gauge("backfill_fleet_lease_limit", "Batch requests the controller allows in flight."),
        leases_in_use=latest_gauge("backfill_fleet_leases_in_use", "Capacity leases held by batch requests."),
        interactive=latest_gauge(
            "backfill_fleet_interactive_inflight", "Interactive requests in flight on the fleet, as estimated."
        ),
        decided_at=latest_gauge(
            "backfill_capacity_decision_timestamp_seconds",
            "Unix time of the controller's latest decision (the gauges above are as of then).",
        ),
        validation=histogram(
            "backfill_validation_duration_seconds",
            "Validation task runs, by how they ended (in_progress, failed, busy, waiting, ...).",
            TASK_BUCKETS,
            ("result",),
        ),
        finalization=histogram(
            "backfill_finalization_duration_seconds",
            "Finalization task runs, by the batch's status afterwards (completed, expired, cancelled, ...).",
            TASK_BUCKETS,
            ("result",),
        ),
    )


def _safely(record: Callable[P, None]) -> Callable[P, None]:
    @functools.wraps(record)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            record(*args, **kwargs)
        except Exception:  # a metric must never fail the request or period it measures
            log.warning("could not record %s", record.__name__, exc_info=True)

    return guarded


@_safely
def record_fleet_reply(reply: FleetReply) -> None:
    m = scheduler_metrics()
    m.dispatched.labels(code=str(reply.status_code) if reply.sent else "unsent").inc()
    if reply.sent:
        m.fleet_latency.observe(reply.latency_s)


@_safely
def record_decision(decision: Decision) -> None:
    m = scheduler_metrics()
    m.decisions.labels(reason=decision.reason).inc()
    m.lease_limit.set(decision.limit)
    m.leases_in_use.set(decision.batch)
    m.interactive.set(decision.interactive)
    m.decided_at.set(time.time())
    if decision.itl_s is not None:
        m.itl.observe(decision.itl_s)
    if decision.ttft_s is not None:
        m.ttft.observe(decision.ttft_s)


def timed(task: Literal["validation", "finalization"]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Observe how long a task body runs, labelled with what it returned (`raised` if it raised)."""

    def decorate(body: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(body)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            started = time.monotonic()
            result = "raised"
            try:
                value = body(*args, **kwargs)
                result = str(value) if value is not None else "missing"
                return value
            finally:
                _observe(task, result, time.monotonic() - started)

        return run

    return decorate


@_safely
def _observe(task: Literal["validation", "finalization"], result: str, seconds: float) -> None:
    m = scheduler_metrics()
    (m.validation if task == "validation" else m.finalization).labels(result=result).observe(seconds)
