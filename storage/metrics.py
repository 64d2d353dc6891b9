"""Prometheus plumbing shared by every backfill process: prometheus-client's multiprocess mode.

The API serves `/metrics`, but most numbers are made elsewhere: drains in the Celery worker's
forked children, the capacity controller in the scheduler, the ledger wherever results are
recorded. Each process writes its counters, histograms and gauges to memory-mapped files in one
directory (`BACKFILL_METRICS_DIR`, by default `BACKFILL_HOME/metrics`), and `/metrics` adds up
every file there at scrape time. So counters are correct across processes and survive a process
that exits (its file stays: a sum never goes backwards because a worker child was recycled).

The directory must be shared by every process that should appear in one scrape: the same host
directory for `backfill up`, a shared volume in the compose stack. File names carry the host name
as well as the pid, so containers sharing the volume (each a pid 1) never write the same file.
It is emptied when a deployment starts (`backfill up` does; the compose stack mounts a tmpfs
volume), never by a process that starts beside running ones: that would take back counts.

Metrics are built on first use, not at import: by then the process's settings are final, and
`configure_multiprocess` has pointed prometheus-client at the directory before any value exists.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from backfill.storage.settings import get_settings

log = logging.getLogger("backfill.metrics")

ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"  # where prometheus-client's file-backed values write
_HOST = socket.gethostname().replace("_", "-") or "host"  # '_' separates the file name's fields
_lock = threading.Lock()
_configured: dict[str, Path | None] = {}


def metrics_dir() -> Path:
    s = get_settings()
    return Path(s.metrics_dir).expanduser().resolve() if s.metrics_dir else s.home / "metrics"


# This process's name in the metric files' names. prometheus-client asks for it at every value
# it changes (to notice a fork), so it is made once, and again in a forked child.
_this_process = {"id": f"{_HOST}-{os.getpid()}"}


def _forked() -> None:
    _this_process["id"] = f"{_HOST}-{os.getpid()}"


os.register_at_fork(after_in_child=_forked)


def _process_id() -> str:
    return _this_process["id"]


def configure_multiprocess() -> Path | None:
    """Point prometheus-client at the metrics directory, once per process; the directory, or None
    when it cannot be created (the process then keeps its metrics in memory, unseen by /metrics,
    and says so once rather than failing the work it measures)."""
    with _lock:
        if "dir" in _configured:
            return _configured["dir"]
        path: Path | None = metrics_dir()
        assert path is not None
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("metrics stay in this process: cannot create %s (%s)", path, exc)
            path = None
        if path is not None:
            # prometheus-client reads the directory from the environment when it opens a file.
            os.environ[ENV_VAR] = str(path)
            values.ValueClass = values.MultiProcessValue(process_identifier=_process_id)  # type: ignore[no-untyped-call]
        _configured["dir"] = path
        return path


def clear_metrics_dir(path: Path) -> None:
    """Empty the directory before a deployment's processes start (never while they run)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)


def counter(name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
    configure_multiprocess()
    return Counter(name, documentation, labelnames=labels, registry=None)


def histogram(name: str, documentation: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
    configure_multiprocess()
    return Histogram(name, documentation, labelnames=labels, buckets=buckets, registry=None)


def latest_gauge(name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
    """A gauge whose value is the one most recently set by any process (e.g. the capacity
    controller's limit): a process that stops keeps its last value, so pair it with a timestamp."""
    configure_multiprocess()
    return Gauge(name, documentation, labelnames=labels, registry=None, multiprocess_mode="mostrecent")


def scrape_registry(*collectors: Collector) -> CollectorRegistry:
    """A registry for one scrape: every process's files, plus collectors that read at scrape time."""
    registry = CollectorRegistry(auto_describe=False)
    path = configure_multiprocess()
    if path is not None:
        MultiProcessCollector(registry, path=str(path))  # type: ignore[no-untyped-call]
    for collector in collectors:
        registry.register(collector)
    return registry
