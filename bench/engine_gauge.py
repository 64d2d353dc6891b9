"""What the engine was doing during a bench run, and which cores each side ran on.

`RunningGauge` samples vLLM's `vllm:num_requests_running` (sequences in the running batch) from
its Prometheus endpoint while a runner works; its mean over the busy window (from the first
sample with a sequence running to the last) says how full each runner kept the engine.
`pinned` puts this process (and what it starts from then on: children inherit the affinity) on
the given cores, as `taskset` would.
"""

from __future__ import annotations

import contextlib
import os
import threading
import urllib.request
from collections.abc import Iterator

GAUGE = "vllm:num_requests_running"


def read_gauge(metrics_url: str, name: str = GAUGE) -> float | None:
    """The gauge summed over its label sets; None when the endpoint is not up (yet)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    total = None
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


class RunningGauge:
    """Samples the gauge every `every_s` in a thread between `with` and its end."""

    def __init__(self, metrics_url: str, *, every_s: float = 0.5) -> None:
        self.metrics_url = metrics_url
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RunningGauge:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            value = read_gauge(self.metrics_url)
            if value is not None:
                self.samples.append(value)

    def busy_mean(self) -> float:
        """The mean from the first sample with a sequence running to the last one."""
        busy = [i for i, v in enumerate(self.samples) if v > 0]
        if not busy:
            return 0.0
        window = self.samples[busy[0] : busy[-1] + 1]
        return sum(window) / len(window)


@contextlib.contextmanager
def pinned(cores: set[int] | None) -> Iterator[None]:
    """This process on `cores` for the block (None: as it was); processes started meanwhile keep them."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def parse_cores(spec: str) -> set[int]:
    """'0' or '0,2' or '0-3' (taskset's list form)."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out
