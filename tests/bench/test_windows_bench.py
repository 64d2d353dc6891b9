"""The windows benchmarks (issue 21 B): the simulation's relaxed extra takes effect, and the stack
benchmark's two runs differ only in the escalation settings."""

from __future__ import annotations

from types import SimpleNamespace

from backfill.storage.settings import Settings
from bench.agent_trace import TraceSpec, build_trace
from bench.harvest_results import SloRule
from bench.windows import Trace, simulate
from bench.windows_stack import SUBMIT_LEAD_S, Plan, stack_settings, trace_spec


def test_the_simulated_relaxed_extra_takes_effect() -> None:
    t = Trace(short_batches=6, long_batches=1)
    small, large = (simulate(t, escalate=True, extra=e, overflow=16) for e in (2, 8))
    # More room beyond the limit: fewer lines need the overflow, at some cost to the SLO.
    assert large.overflow_share < small.overflow_share
    assert large.attainment <= small.attainment


FLEET = SimpleNamespace(
    frontend_metrics_url="http://127.0.0.1:1/metrics", worker_metrics_urls=[("agg", "http://127.0.0.1:2/metrics")]
)
SLO = SloRule(ttft_s=0.2, itl_s=0.02)


def test_baseline_is_todays_policy_and_escalating_adds_only_the_escalation() -> None:
    plan = Plan()
    base = stack_settings(plan, fleet=FLEET, slo=SLO, overflow_url=None)
    esc = stack_settings(plan, fleet=FLEET, slo=SLO, overflow_url="http://127.0.0.1:3/v1")
    assert base["BACKFILL_ESCALATION_INFLIGHT"] == "0" and base["BACKFILL_OVERFLOW_URLS"] == ""
    assert esc["BACKFILL_ESCALATION_INFLIGHT"] == str(plan.extra)
    assert esc["BACKFILL_OVERFLOW_URLS"] == "http://127.0.0.1:3/v1"
    differs = {k for k in base.keys() | esc.keys() if base.get(k) != esc.get(k)}
    assert differs == {"BACKFILL_ESCALATION_INFLIGHT", "BACKFILL_OVERFLOW_URLS"}
    # The settings a stack starts with parse, with the compressed windows configured.
    s = Settings(**{k.removeprefix("BACKFILL_").lower(): v for k, v in esc.items()})
    assert s.capacity_controlled and s.overflow_urls == ["http://127.0.0.1:3/v1"]
    assert s.completion_windows["60s"] == 60 and s.completion_windows["180s"] == 180


def test_the_run_outlasts_every_window_under_a_steady_load() -> None:
    plan = Plan()
    last_short = SUBMIT_LEAD_S + (plan.short_batches - 1) * plan.short_every_s + plan.short_window_s
    assert plan.run_s > max(last_short, SUBMIT_LEAD_S + plan.long_window_s)
    spec = trace_spec(plan, plan.run_s)
    sessions = build_trace(TraceSpec(**spec))
    # Sessions keep arriving to the end: no lull for the batches to finish in.
    assert max(s.start_s for s in sessions) > plan.run_s - 15
