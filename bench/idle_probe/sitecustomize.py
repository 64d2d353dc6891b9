"""Probes in a drain, for `bench.idle_engine` only (on PYTHONPATH with BACKFILL_BENCH_PROBE=1).

Python imports `sitecustomize` at start-up; in a `backfill worker` this wraps three names the
drain loop calls (`scheduler.drain.dispatcher`) so the bench can see, from the metrics directory:
- `bench_drain_fleet_calls_in_flight` (livesum): requests sent to the fleet and not yet answered;
- `bench_drain_claimed_lines_total`: lines claimed;
- `bench_drain_loop_lag_seconds` (livemax): how late a 50 ms sleep on the drain's event loop
  wakes, the worst of the last half second.
Nothing in the service imports this; the wrappers only count around the calls they wrap.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("BACKFILL_BENCH_PROBE") == "1" and "worker" in sys.argv[1:3]:
    import asyncio
    import functools
    import time
    from typing import Any

    from prometheus_client import Counter, Gauge

    from backfill.scheduler.drain import dispatcher as _d
    from backfill.storage.metrics import configure_multiprocess

    _metrics: dict[str, Any] = {}

    def _m(name: str) -> Any:
        # Made in the pool child that first uses them (after the fork: a file of its own).
        if not _metrics:
            configure_multiprocess()
            _metrics["calls"] = Gauge(
                "bench_drain_fleet_calls_in_flight", "", registry=None, multiprocess_mode="livesum"
            )
            _metrics["claimed"] = Counter("bench_drain_claimed_lines", "", registry=None)
            _metrics["lag"] = Gauge("bench_drain_loop_lag_seconds", "", registry=None, multiprocess_mode="livemax")
        return _metrics[name]

    _post = getattr(_d, "post_request")  # noqa: B009 (a name the module imports)

    @functools.wraps(_post)
    async def _post_counted(*args: Any, **kwargs: Any) -> Any:
        g = _m("calls")
        g.inc()
        try:
            return await _post(*args, **kwargs)
        finally:
            g.dec()

    _claim = getattr(_d, "claim_lines")  # noqa: B009

    @functools.wraps(_claim)
    def _claim_counted(*args: Any, **kwargs: Any) -> Any:
        got = _claim(*args, **kwargs)
        _m("claimed").inc(len(got))
        return got

    async def _watch_lag() -> None:
        recent: list[float] = []
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.05)
            recent = [*recent[-9:], time.monotonic() - t - 0.05]
            _m("lag").set(max(recent))

    _run = _d.Dispatcher.run

    @functools.wraps(_run)
    async def _run_watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        watcher = asyncio.create_task(_watch_lag())
        try:
            return await _run(self, *args, **kwargs)
        finally:
            watcher.cancel()
            _m("lag").set(0.0)

    setattr(_d, "post_request", _post_counted)  # noqa: B010
    setattr(_d, "claim_lines", _claim_counted)  # noqa: B010
    setattr(_d.Dispatcher, "run", _run_watched)  # noqa: B010
