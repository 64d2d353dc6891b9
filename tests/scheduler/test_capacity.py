"""Controller math and telemetry parsing, on hand-made snapshots (the real fleet is in tests/e2e)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from backfill.scheduler.capacity.law import ControlConfig, Controller, ObsDelta, Slo, StepModel
from backfill.scheduler.capacity.telemetry import (
    FleetSnapshot,
    FleetTelemetry,
    FrontendStats,
    KvModel,
    WorkerStats,
    _Buckets,
    _Counter,
    bucket_quantile,
    parse_prometheus,
)
from backfill.scheduler.drain.shedding import shed_count
from backfill.storage.settings import MetricsEndpoint, parse_metrics_endpoints

SLO = Slo(ttft_s=0.2, itl_s=0.020)


def snap(
    at: float,
    *,
    itl: float | None = 0.010,
    ttft: float | None = 0.05,
    kv: float = 0.1,
    waiting: int = 0,
    running: int = 10,
    inflight: int = 0,
    streaming: int = 0,
    arrivals: int = 0,
    preempted: int = 0,
    workers: int = 2,
) -> FleetSnapshot:
    fe = FrontendStats(
        inflight=inflight,
        queued=0,
        itl_s=itl,
        ttft_s=ttft,
        active_decode_blocks=0,
        active_prefill_tokens=0,
        kv_tokens_per_worker=2048 * 64,
        max_num_seqs=64,
        rejected=0,
        streaming=streaming,
        stream_arrivals=arrivals,
    )
    ws = tuple(
        WorkerStats(
            role="agg",
            url=f"w{i}",
            kv_usage=kv,
            running=running,
            waiting=waiting,
            itl_s=itl,
            itl_n=100 if itl is not None else 0,
            ttft_s=ttft,
            ttft_n=5 if ttft is not None else 0,
            preempted=preempted,
        )
        for i in range(workers)
    )
    return FleetSnapshot(at=at, frontend=fe, workers=ws, missing=())


def run(c: Controller, n: int, t: float, batch: int | None, **kw: Any) -> tuple[float, list[str]]:
    """n periods; `batch` in flight, or (None) as many as the limit allows."""
    reasons = []
    for _ in range(n):
        t += 0.25
        b = int(c.limit) if batch is None else batch
        d = c.step(snap(t, inflight=b + kw.get("streaming", 0), **kw), b, ObsDelta(), t)
        reasons.append(d.reason)
    return t, reasons


def test_no_telemetry_means_the_floor() -> None:
    c = Controller(ControlConfig(slo=SLO, floor=2, ceiling=64))
    c.limit = 40
    assert c.step(None, 30, ObsDelta(), 1.0).limit == 2
    stale = snap(0.0)
    assert c.step(stale, 30, ObsDelta(), 5.0).reason == "no-telemetry"  # 5 s old
    missing = FleetSnapshot(at=5.0, frontend=stale.frontend, workers=stale.workers, missing=("http://w1/metrics",))
    assert c.step(missing, 30, ObsDelta(), 5.0).limit == 2


def test_grows_under_the_slo_only_while_leases_are_used() -> None:
    c = Controller(ControlConfig(slo=SLO, floor=1, ceiling=64))
    t, _ = run(c, 1, 0.0, batch=1, itl=0.008)
    assert c.limit > 1
    t, _ = run(c, 8, t, batch=None, itl=0.008)
    grown = c.limit
    assert grown >= 8
    _, reasons = run(c, 4, t, batch=1, itl=0.008)  # demand fell away: no growth on paper
    assert c.limit == grown and set(reasons) == {"steady"}


def test_growth_restarts_from_a_cut_below_one() -> None:
    c = Controller(ControlConfig(slo=SLO, floor=0, ceiling=64, smoothing=1.0))
    c.limit = 1
    d = c.step(snap(1.0, itl=0.030), 1, ObsDelta(), 1.0)  # a hard cut leaves half a lease
    assert d.limit == 0 and 0 < c.limit < 1
    _, reasons = run(c, 8, 2.0, batch=None, itl=0.008)  # nothing in flight: the room is back
    assert "grow" in reasons and c.limit >= 2


def test_growth_slows_near_the_target() -> None:
    far, near = Controller(ControlConfig(slo=SLO, ceiling=200)), Controller(ControlConfig(slo=SLO, ceiling=200))
    far.limit = near.limit = 40
    far.step(snap(1.0, itl=0.006), 40, ObsDelta(), 1.0)
    near.step(snap(1.0, itl=0.015), 40, ObsDelta(), 1.0)
    assert far.limit - 40 > near.limit - 40 >= 1


def test_cuts_in_proportion_when_latency_nears_the_slo() -> None:
    c = Controller(ControlConfig(slo=SLO, ceiling=200, smoothing=1.0))
    c.limit = 40
    d = c.step(snap(1.0, itl=0.0195), 40, ObsDelta(), 1.0)  # 0.975 of the SLO
    assert d.reason == "cut" and 30 <= d.limit < 40 and d.shed_to is None
    d = c.step(snap(1.25, itl=0.008), d.limit, ObsDelta(), 1.25)
    assert d.reason == "hold"  # no growth right after a cut


def test_over_the_slo_cuts_hard_and_sheds() -> None:
    c = Controller(ControlConfig(slo=SLO, ceiling=200, smoothing=1.0))
    c.limit = 40
    d = c.step(snap(1.0, itl=0.025), 40, ObsDelta(), 1.0)
    assert d.reason == "over-slo" and d.limit == 20 and d.shed_to == 20


def test_overload_preemption_and_a_full_cache_cut_hard() -> None:
    cases: list[tuple[ObsDelta, dict[str, Any], str]] = [
        (ObsDelta(n=5, overloaded=1), {}, "overload"),
        (ObsDelta(), {"preempted": 1}, "preempted"),
        (ObsDelta(), {"kv": 0.93}, "kv-full"),
    ]
    for obs, kw, reason in cases:
        c = Controller(ControlConfig(slo=SLO, ceiling=200))
        c.limit = 40
        d = c.step(snap(1.0, **kw), 40, obs, 1.0)
        assert d.reason == reason and d.limit == 20 and d.shed_to == 20


def test_a_queue_counts_once_it_persists() -> None:
    c = Controller(ControlConfig(slo=SLO, ceiling=200))
    c.limit = 40
    _, reasons = run(c, 3, 0.0, batch=40, waiting=6, running=30)
    assert reasons[:2] != ["queue", "queue"] and reasons[2] == "queue"
    assert c.limit == 20


def _step_ms(kv: float, running: int) -> float:
    """A decoder whose step costs 6 ms, 40 ms per unit of KV usage and 0.1 ms per sequence."""
    return 0.006 + 0.040 * kv + 0.0001 * running


def test_the_step_model_learns_the_decoders_step_time() -> None:
    model = StepModel()
    assert model.coefficients() is None  # not before it has seen enough
    for i in range(60):
        kv, running = 0.05 + 0.01 * (i % 30), 4 + (7 * i) % 40
        w = snap(0.0, itl=_step_ms(kv, running), kv=kv, running=running).workers[0]
        model.observe([w])
    a, b, c = model.coefficients() or (0.0, 0.0, 0.0)
    assert a == pytest.approx(0.006, rel=0.01) and b == pytest.approx(0.040, rel=0.01)
    assert c == pytest.approx(0.0001, rel=0.05)
    # Two decoders at KV 0.2 / 30 sequences and 0.3 / 30; each batch request adds half a sequence
    # and half of 2% of a cache to each: the fuller one reaches 20 ms first.
    ws = [replace(w, kv_usage=u, running=30) for w, u in zip(snap(0.0).workers, (0.2, 0.3), strict=True)]
    per_request = (0.040 * 0.02 + 0.0001) / 2
    expected = 10 + (0.020 - _step_ms(0.3, 30)) / per_request
    assert model.batch_limit(ws, 10, 0.02, 0.020) == pytest.approx(expected, rel=0.01)
    # A target under an empty decoder's 6 ms step: no batch level reaches it, so no cap (shedding
    # every batch request would not bring the step under it).
    assert model.batch_limit(ws, 10, 0.02, 0.005) is None


def test_load_landing_on_a_decoder_sheds_before_the_smoothed_itl_moves() -> None:
    # Interactive requests with long contexts land on the decoders: their KV usage jumps from 0.2
    # to 0.45 while the window ITL still reads what the last steps took. The model's cap drops
    # below what is in flight and the excess is shed in the same period.
    c = Controller(ControlConfig(slo=SLO, ceiling=200, kv=KvModel(576, 2048 * 64 * 576)))
    c.limit = 40
    t = 0.0
    for i in range(30):
        t += 0.25
        kv, running = 0.15 + 0.01 * (i % 10), 20 + i % 15
        c.step(snap(t, itl=_step_ms(kv, running), kv=kv, running=running), 30, ObsDelta(), t)
    assert c.step_limit is not None
    calm = c.step(snap(t + 0.25, itl=_step_ms(0.2, 30), kv=0.2, running=30), 30, ObsDelta(), t + 0.25)
    assert calm.reason != "step-model" and calm.shed_to is None
    landed = snap(t + 0.5, itl=_step_ms(0.2, 30), kv=0.45, running=34, streaming=4, inflight=34)
    d = c.step(landed, 30, ObsDelta(), t + 0.5)
    assert d.reason == "step-model" and d.shed_to is not None and d.shed_to < 30


def test_limit_respects_sequence_slots_and_the_kv_model() -> None:
    c = Controller(ControlConfig(slo=SLO, ceiling=1000))
    c.limit = 500
    d = c.step(snap(1.0), 500, ObsDelta(), 1.0)
    assert d.cap == 96 and d.limit == 96  # 2 x 64 slots, a quarter kept for interactive work
    # A leaner cache format holds more tokens in the same bytes: the KV cap rises with it.
    budget = 2048 * 64 * 576
    fp8 = Controller(ControlConfig(slo=SLO, ceiling=1000, seq_reserve=0.0, kv=KvModel(576, budget)))
    nvfp4 = Controller(ControlConfig(slo=SLO, ceiling=1000, seq_reserve=0.0, kv=KvModel(352, budget)))
    obs = ObsDelta(n=10, prompt_tokens=10 * 3000, completion_tokens=10 * 1000)  # 4000-token requests
    for ctl in (fp8, nvfp4):
        for i in range(30):
            ctl.step(snap(1.0 + i), 0, obs, 1.0 + i)
    cap_fp8, cap_nvfp4 = fp8.step(snap(40.0), 0, ObsDelta(), 40.0).cap, nvfp4.step(snap(40.0), 0, ObsDelta(), 40.0).cap
    assert cap_fp8 == int(2048 * 64 * 2 * 0.8 / 4000) and abs(cap_nvfp4 / cap_fp8 - 576 / 352) < 0.05


def test_idle_target_stretches_and_the_first_arrival_sheds_back() -> None:
    cfg = ControlConfig(slo=SLO, ceiling=200, idle_target=1.5, idle_after_s=1.0, smoothing=1.0)
    c = Controller(cfg)
    c.limit = 60
    t, _ = run(c, 8, 0.0, batch=60, itl=0.024)  # above the SLO, below 1.5 x: fine with nobody waiting
    assert c.limit >= 60
    c._itl_floor = 0.006
    d = c.step(snap(t + 0.25, itl=0.024, streaming=1, arrivals=1, inflight=61), 60, ObsDelta(), t + 0.25)
    # Back to what the SLO allows: (cut_above x 20 ms - 6 ms) / (24 ms - 6 ms) of 60 in flight.
    expected = int(60 * (cfg.cut_above * 0.020 - 0.006) / (0.024 - 0.006))
    assert d.reason == "wake" and d.shed_to == expected == d.limit and 30 < expected < 50


def test_shed_count_is_each_drains_share_of_the_excess() -> None:
    assert shed_count(total=40, target=20, mine=10) == 5
    assert shed_count(total=40, target=20, mine=30) == 15
    assert shed_count(total=20, target=20, mine=10) == 0
    assert shed_count(total=41, target=0, mine=1) == 1


PROM = """# HELP vllm:kv_cache_usage_perc KV usage
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 7
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01"} 3
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100
dynamo_frontend_requests_started_total{endpoint="chat_completions",request_type="stream"} 4
dynamo_frontend_requests_started_total{endpoint="chat_completions",request_type="unary"} 9
dynamo_request_queue 0
"""


def test_prometheus_text_is_parsed_and_filtered() -> None:
    s = parse_prometheus(PROM)
    assert s["vllm:kv_cache_usage_perc"] == [('engine="0",model_name="m"', 0.25)]
    assert s["dynamo_request_queue"] == [("", 0.0)]
    assert len(s["dynamo_frontend_requests_started_total"]) == 2
    only = parse_prometheus(PROM, {"vllm:num_requests_running"})
    assert list(only) == ["vllm:num_requests_running"]


def test_histograms_become_window_means() -> None:
    c = _Counter()
    assert c.window(1.5, 100) == (None, 0)  # the first scrape only sets the baseline
    assert c.window(2.5, 150) == (0.02, 50)
    assert c.window(2.5, 150) == (None, 0)  # nothing happened in this window
    assert c.window(0.1, 10) == (None, 0)  # the worker restarted: a new baseline


def test_endpoint_specs() -> None:
    deps = parse_metrics_endpoints("frontend=http://f/metrics,agg=http://a/metrics;http://g/metrics")
    assert deps == [
        [MetricsEndpoint("frontend", "http://f/metrics"), MetricsEndpoint("agg", "http://a/metrics")],
        [MetricsEndpoint("frontend", "http://g/metrics")],
    ]


def test_a_frontend_alone_is_enough_telemetry() -> None:
    # Only the frontend's /metrics configured (the default): latency and queues come from it.
    c = Controller(ControlConfig(slo=SLO, floor=1, ceiling=64))
    t, reasons = run(c, 20, 0.0, None, workers=0)
    assert "no-telemetry" not in reasons and c.limit > 1
    t, reasons = run(c, 4, t, None, workers=0, itl=0.030)
    assert reasons[0] == "over-slo" and c.limit < 64


def split_snap(at: float, *, prefill_busy: int = 0, streaming: int = 0, arrivals: int = 0, **kw: Any) -> FleetSnapshot:
    """A split fleet: one prefill engine with `prefill_busy` requests on it, two decode engines."""
    base = snap(at, streaming=streaming, arrivals=arrivals, **kw)
    assert base.frontend is not None
    prefill = WorkerStats(
        role="prefill", url="p0", kv_usage=0.1, running=min(prefill_busy, 1), waiting=max(0, prefill_busy - 1),
        itl_s=None, itl_n=0, ttft_s=None, ttft_n=0, preempted=0,
    )  # fmt: skip
    decode = tuple(replace(w, role="decode") for w in base.workers)
    return replace(base, workers=(prefill, *decode))


def test_a_busy_prefill_engine_stops_growth_while_interactive_work_is_around() -> None:
    cfg = ControlConfig(slo=SLO, ceiling=200, prefill_busy_target=0.4, prefill_busy_smoothing=1.0)
    c = Controller(cfg)
    c.limit = 40
    d = c.step(split_snap(1.0, prefill_busy=1, streaming=1, inflight=41), 40, ObsDelta(), 1.0)
    # 1 request on the engine against 0.4: cut in proportion (no shedding), not grown.
    assert d.reason == "prefill-busy" and d.limit < 40 and d.shed_to is None
    c2 = Controller(cfg)
    c2.limit = 40
    d = c2.step(split_snap(1.0, prefill_busy=0, streaming=1, inflight=41), 40, ObsDelta(), 1.0)
    assert d.reason == "grow"
    # With no interactive request for idle_after_s, no prompt waits behind the batch's.
    c3 = Controller(cfg)
    c3.limit = 40
    d = c3.step(split_snap(5.0, prefill_busy=3, inflight=40), 40, ObsDelta(), 5.0)
    assert d.reason == "grow"
    # Off by default: the same busy engine does not stop growth.
    c4 = Controller(ControlConfig(slo=SLO, ceiling=200))
    c4.limit = 40
    d = c4.step(split_snap(1.0, prefill_busy=3, streaming=1, inflight=41), 40, ObsDelta(), 1.0)
    assert d.reason == "grow"


def test_the_ttft_tail_comes_from_the_histograms_window_buckets() -> None:
    assert bucket_quantile([(0.1, 0.0), (0.22, 8.0), (0.47, 10.0), (float("inf"), 10.0)], 0.9) == pytest.approx(0.345)
    assert bucket_quantile([(0.1, 0.0), (float("inf"), 4.0)], 0.9) == 0.1  # the highest finite bound
    assert bucket_quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.9) is None  # no first token
    b = _Buckets()
    line = 'model="m",le="{}"'
    assert b.window([(line.format("0.1"), 5.0), (line.format("+Inf"), 9.0)]) == []  # the baseline
    assert b.window([(line.format("0.1"), 6.0), (line.format("+Inf"), 12.0)]) == [(0.1, 1.0), (float("inf"), 3.0)]
    assert b.window([(line.format("0.1"), 1.0), (line.format("+Inf"), 2.0)]) == []  # a restart
    # Parsed from the frontend's text, per scrape window.
    tel = FleetTelemetry([MetricsEndpoint("frontend", "f")])
    texts = iter(
        [
            'dynamo_frontend_time_to_first_token_seconds_bucket{le="0.1"} 0\n'
            'dynamo_frontend_time_to_first_token_seconds_bucket{le="+Inf"} 0\n',
            'dynamo_frontend_time_to_first_token_seconds_bucket{le="0.1"} 1\n'
            'dynamo_frontend_time_to_first_token_seconds_bucket{le="0.22"} 10\n'
            'dynamo_frontend_time_to_first_token_seconds_bucket{le="+Inf"} 10\n',
        ]
    )
    tel._get = lambda url: next(texts)  # type: ignore[method-assign]
    assert tel.scrape().frontend.ttft_tail_s is None  # type: ignore[union-attr]
    assert tel.scrape().frontend.ttft_tail_s == pytest.approx(0.1 + 0.12 * 8 / 9)  # type: ignore[union-attr]


def test_the_ttft_tail_steers_where_a_target_is_set() -> None:
    cfg = ControlConfig(slo=SLO, ceiling=200, smoothing=1.0, ttft_tail_target=0.9)
    c = Controller(cfg)
    c.limit = 40
    tail = replace(snap(1.0), frontend=replace(snap(1.0).frontend, ttft_tail_s=0.175))  # type: ignore[type-var]
    d = c.step(tail, 40, ObsDelta(), 1.0)  # 0.175 s against 0.9 x 0.2 s: 0.97 of it
    assert d.reason == "cut" and d.limit < 40
    off = Controller(ControlConfig(slo=SLO, ceiling=200, smoothing=1.0))
    off.limit = 40
    assert off.step(tail, 40, ObsDelta(), 1.0).reason == "grow"


def test_the_prefill_busy_target_reaches_the_law_from_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from backfill.scheduler.runtime import control_config
    from backfill.storage.settings import Settings

    assert control_config(Settings()).prefill_busy_target == 0.0  # off unless asked for
    monkeypatch.setenv("BACKFILL_CAPACITY_PREFILL_BUSY_TARGET", "0.4")
    assert control_config(Settings()).prefill_busy_target == 0.4
    monkeypatch.setenv("BACKFILL_CAPACITY_PREFILL_BUSY_TARGET", "-1")
    with pytest.raises(ValueError):
        Settings()


def test_engines_with_priority_scheduling_leave_the_step_model_out_and_hold_the_mean_ttft_to_the_slo() -> None:
    # The engines take interactive prompts before batch ones: a burst never waits behind batch
    # work, so the smoothed latency is fast enough and no step-time cap is set; and a mean TTFT
    # of 0.8 x the SLO (over the 0.7 x a first-come-first-served fleet may reach) leaves room.
    prio = Controller(ControlConfig(slo=SLO, ceiling=200, engine_priority=True))
    fifo = Controller(ControlConfig(slo=SLO, ceiling=200))
    for c in (prio, fifo):
        t = 0.0
        for i in range(30):
            t += 0.25
            kv, running = 0.15 + 0.01 * (i % 10), 20 + i % 15
            c.step(snap(t, itl=_step_ms(kv, running), kv=kv, running=running), 30, ObsDelta(), t)
    assert prio.step_limit is None and fifo.step_limit is not None

    slow_first_token = snap(1.0, ttft=0.8 * SLO.ttft_s)
    fifo = Controller(ControlConfig(slo=SLO, ceiling=200, smoothing=1.0))
    fifo.limit = 40
    assert fifo.step(slow_first_token, 40, ObsDelta(), 1.0).reason in ("cut", "over-slo")
    prio = Controller(ControlConfig(slo=SLO, ceiling=200, smoothing=1.0, engine_priority=True))
    prio.limit = 40
    assert prio.step(slow_first_token, 40, ObsDelta(), 1.0).reason == "grow"


def test_engine_priority_reaches_the_law_from_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from backfill.scheduler.runtime import control_config
    from backfill.storage.settings import Settings

    assert control_config(Settings()).engine_priority is False
    monkeypatch.setenv("BACKFILL_CAPACITY_ENGINE_PRIORITY", "true")
    assert control_config(Settings()).engine_priority is True


def test_engines_with_priority_scheduling_cut_less_deep_when_latency_crosses_the_slo() -> None:
    # An overshoot there slows every step a little; it does not queue interactive prompts behind
    # batch work, so the hard cut keeps 0.8 of what is in flight (half elsewhere), and sheds to it.
    over = snap(1.0, itl=1.2 * SLO.itl_s)
    for priority, kept in ((False, 20), (True, 32)):
        c = Controller(ControlConfig(slo=SLO, ceiling=200, smoothing=1.0, engine_priority=priority))
        c.limit = 40
        d = c.step(over, 40, ObsDelta(), 1.0)
        assert (d.reason, d.limit, d.shed_to) == ("over-slo", kept, kept)
