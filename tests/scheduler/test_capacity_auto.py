"""Capacity control is on by default (`auto`): the controller steers wherever the fleet's metrics
answer; while they never have, admission holds the fixed bound and the scheduler says so loudly;
once seen, losing them fails closed like `on`. `true`/`false` still read as on/off."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from backfill.devfleet.processes import free_port
from backfill.scheduler.capacity.admission import Admission, pool_of
from backfill.scheduler.capacity.controller import CapacityLoop, DecisionLog
from backfill.scheduler.capacity.law import ControlConfig, Controller, ObsDelta, Slo
from backfill.scheduler.capacity.telemetry import KvModel
from backfill.scheduler.runtime import control_config, make_capacity_loop
from backfill.storage.leases import RedisLeaseStore, limit_key
from backfill.storage.settings import Settings
from tests.scheduler.test_capacity import snap

# A Dynamo frontend's /metrics, as little of it as the controller needs: nothing in flight.
FRONTEND_METRICS = (
    b"# TYPE dynamo_frontend_inflight_requests gauge\n"
    b'dynamo_frontend_inflight_requests{model="tiny-chat"} 0\n'
    b"# TYPE dynamo_frontend_queued_requests gauge\n"
    b'dynamo_frontend_queued_requests{model="tiny-chat"} 0\n'
)


def test_the_default_is_auto_and_booleans_read_as_on_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BACKFILL_CAPACITY_CONTROL", raising=False)
    assert Settings().capacity_control == "auto" and Settings().capacity_controlled
    for raw, mode in [("true", "on"), ("1", "on"), ("False", "off"), ("off", "off"), ("AUTO", "auto")]:
        monkeypatch.setenv("BACKFILL_CAPACITY_CONTROL", raw)
        assert Settings().capacity_control == mode, raw
    assert not Settings(capacity_control=False).capacity_controlled
    monkeypatch.setenv("BACKFILL_CAPACITY_CONTROL", "sometimes")
    with pytest.raises(ValueError):
        Settings()
    assert control_config(Settings(capacity_control="auto", max_inflight=40)).unseen_limit == 40
    assert control_config(Settings(capacity_control="on", max_inflight=40)).unseen_limit is None


def test_auto_holds_the_fixed_bound_until_telemetry_is_seen_then_fails_closed() -> None:
    controller = Controller(ControlConfig(slo=Slo(ttft_s=0.2, itl_s=0.02), floor=2, ceiling=64, unseen_limit=40))
    t = time.monotonic()
    first = controller.step(None, 0, ObsDelta(), t)
    assert (first.limit, first.reason) == (40, "unseen")
    steered = controller.step(snap(t + 0.25, itl=0.005, inflight=0), 0, ObsDelta(), t + 0.25)
    assert steered.reason not in ("unseen", "no-telemetry")
    lost = controller.step(None, 0, ObsDelta(), t + 0.5)
    assert (lost.limit, lost.reason) == (2, "no-telemetry")  # seen once: fail closed from now on

    on = Controller(ControlConfig(slo=Slo(ttft_s=0.2, itl_s=0.02), floor=2, ceiling=64))
    assert on.step(None, 0, ObsDelta(), t).limit == 2  # `on` never takes the fixed bound


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(FRONTEND_METRICS)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metrics_port() -> Iterator[int]:
    yield free_port()


def test_the_scheduler_loop_publishes_the_fixed_bound_and_warns_until_the_fleet_answers(
    redis_url: str, metrics_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(
        capacity_control="auto",
        max_inflight=24,
        capacity_floor=1,
        fleet_urls=f"http://127.0.0.1:{metrics_port}/v1",
        control_period_s=0.25,
    )
    leases = RedisLeaseStore(redis_url, namespace=f"capauto-{secrets.token_hex(4)}")
    loop = make_capacity_loop(settings, leases=leases)
    assert isinstance(loop, CapacityLoop)
    admission = Admission(leases, fixed_limit=24, ttl_s=60, controlled=settings.capacity_controlled, floor=1)
    say = DecisionLog({0: loop.telemetry})
    with caplog.at_level(logging.WARNING, logger="backfill.scheduler.capacity.controller"):
        for _ in range(3):  # nothing listens on the metrics port yet
            say(0, loop.once())
    assert admission.limit() == 24 and leases.read(limit_key(pool_of(0))) == "24"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fixed bound 24" in warnings[0] and str(metrics_port) in warnings[0]

    server = ThreadingHTTPServer(("127.0.0.1", metrics_port), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reasons = set()
        for _ in range(8):  # the fleet answers: the controller steers (from the floor, growing)
            d = loop.once()
            reasons.add(d.reason)
            time.sleep(0.05)
        assert "unseen" not in reasons and "no-telemetry" not in reasons, reasons
        assert admission.limit() == int(leases.read(limit_key(pool_of(0))) or -1) != 24
    finally:
        server.shutdown()
        server.server_close()
    d = loop.once()  # the metrics go away again: fail closed to the floor, not the fixed bound
    assert (d.reason, admission.limit()) == ("no-telemetry", 1)
    loop.withdraw()
    loop.telemetry.close()


class _Snapshots:
    def scrape(self) -> object:
        return snap(time.monotonic())

    def close(self) -> None:
        pass


def test_the_controller_publishes_the_kv_budget_drains_size_prefix_groups_by(redis_url: str) -> None:
    """The KV the controller's model leaves to batch work (tokens per decoder x decoders x the
    batch share) reaches the drains through the lease store (scheduler/tasks.py passes it to
    the claims); with control off there is none and nothing is sized by KV."""
    leases = RedisLeaseStore(redis_url, namespace=f"capkv-{secrets.token_hex(4)}")
    cfg = ControlConfig(slo=Slo(ttft_s=0.2, itl_s=0.02), floor=1, ceiling=64, kv=KvModel(bytes_per_token=576))
    loop = CapacityLoop(Controller(cfg), _Snapshots(), leases)  # type: ignore[arg-type]
    admission = Admission(leases, fixed_limit=8, ttl_s=60, controlled=True)
    assert admission.kv_budget_tokens() is None  # nothing published yet
    loop.once()
    # snap(): 2 agg decoders reporting 2048 blocks x 64 tokens each, 80% of it open to batch work.
    assert admission.kv_budget_tokens() == int(2048 * 64 * 2 * cfg.kv_batch_share)
    assert Admission(leases, fixed_limit=8, ttl_s=60, controlled=False).kv_budget_tokens() is None


def test_a_controller_cut_to_zero_grows_again_once_the_fleet_is_quiet() -> None:
    """With the floor at 0, an over-SLO fleet is cut to no batch work at all. Nothing running
    then means no latency samples: a stale smoothed latency must not hold the limit at 0
    forever (a batch-only fleet stalled so, with every line pending and nothing sent)."""
    c = Controller(ControlConfig(slo=Slo(ttft_s=0.2, itl_s=0.02), floor=0, ceiling=32))
    t = time.monotonic()
    for _ in range(12):  # batch work alone drives the fleet past its ITL target: cut to 0
        t += 0.25
        b = int(c.limit)
        d = c.step(snap(t, itl=0.08, inflight=b), b, ObsDelta(), t)
    assert d.limit == 0
    limits = []
    for _ in range(12):  # nothing in flight, no tokens, so no latency figures at all
        t += 0.25
        limits.append(c.step(snap(t, itl=None, ttft=None, inflight=0, running=0), 0, ObsDelta(), t).limit)
    assert max(limits) >= 1, f"stuck at {limits}"
