"""The fleet's own telemetry: Prometheus text from the frontend and every worker of a deployment.

A scrape turns counters and histograms into per-window figures (the mean inter-token latency
since the previous scrape, not since the process started), and groups workers into the two
resources batch work competes for: the prefill pool (prompt processing, the engines' waiting
queues) and the decode pool (KV cache occupancy, which sets the decode step time). KV capacity
in tokens is part of the deployment's model: it follows from the cache's byte budget and the
bytes one token's KV row takes (576 for an FP8 MLA row, 352 for NVFP4), not from a constant.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import httpx

from backfill.storage.settings import MetricsEndpoint

ROLES = ("agg", "prefill", "decode")

# Worker (vLLM / Dynamo mocker) series.
KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
W_ITL = "vllm:inter_token_latency_seconds"
W_TTFT = "vllm:time_to_first_token_seconds"
# Frontend (Dynamo) series.
F_INFLIGHT = "dynamo_frontend_inflight_requests"
F_QUEUED = "dynamo_frontend_queued_requests"
F_ITL = "dynamo_frontend_inter_token_latency_seconds"
F_TTFT = "dynamo_frontend_time_to_first_token_seconds"
F_TTFT_BUCKET = f"{F_TTFT}_bucket"
F_DECODE_BLOCKS = "dynamo_frontend_worker_active_decode_blocks"
F_PREFILL_TOKENS = "dynamo_frontend_worker_active_prefill_tokens"
F_TOTAL_BLOCKS = "dynamo_frontend_model_total_kv_blocks"
F_BLOCK_SIZE = "dynamo_frontend_model_kv_cache_block_size"
F_MAX_SEQS = "dynamo_frontend_model_max_num_seqs"
F_REJECTED = "dynamo_frontend_router_admission_rejected_total"
F_STARTED = "dynamo_frontend_requests_started_total"
F_FINISHED = "dynamo_frontend_requests_total"
# Batch lines never stream (validation refuses `stream: true`), so streamed requests in flight
# at the frontend are interactive ones, counted without any lag from the batch side's churn.
STREAM_LABEL = 'request_type="stream"'

_WORKER_NAMES = (
    KV_USAGE,
    RUNNING,
    WAITING,
    PREEMPTIONS,
    f"{W_ITL}_sum",
    f"{W_ITL}_count",
    f"{W_TTFT}_sum",
    f"{W_TTFT}_count",
)
_FRONTEND_NAMES = (
    F_INFLIGHT,
    F_QUEUED,
    f"{F_ITL}_sum",
    f"{F_ITL}_count",
    f"{F_TTFT}_sum",
    f"{F_TTFT}_count",
    F_TTFT_BUCKET,
    F_DECODE_BLOCKS,
    F_PREFILL_TOKENS,
    F_TOTAL_BLOCKS,
    F_BLOCK_SIZE,
    F_MAX_SEQS,
    F_REJECTED,
    F_STARTED,
    F_FINISHED,
)


def parse_prometheus(text: str, names: Collection[str] | None = None) -> dict[str, list[tuple[str, float]]]:
    """Samples by metric name: (raw label text, value). Only `names` are kept when given.

    Deliberately small: the controller reads a handful of series several times a second, so
    lines are filtered by name before anything else is done with them."""
    wanted = set(names) if names is not None else None
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        if 0 <= brace < space:
            name = line[:brace]
            close = line.rfind("}")
            labels, rest = line[brace + 1 : close], line[close + 1 :]
        else:
            name, labels, rest = line[:space], "", line[space:]
        if wanted is not None and name not in wanted:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        out.setdefault(name, []).append((labels, value))
    return out


def only_model(text: str, model: str) -> str:
    """Prometheus text without the samples labelled with a model other than `model` (Dynamo's
    frontend labels its per-model series `model="..."`); unlabelled samples stay."""
    mine = f'model="{model}"'
    return "\n".join(line for line in text.splitlines() if 'model="' not in line or mine in line)


def _total(samples: dict[str, list[tuple[str, float]]], name: str) -> float | None:
    values = samples.get(name)
    return sum(v for _, v in values) if values else None


def _max(samples: dict[str, list[tuple[str, float]]], name: str) -> float | None:
    values = samples.get(name)
    return max(v for _, v in values) if values else None


@dataclass(frozen=True)
class KvModel:
    """KV capacity of one decoder, from the cache's byte budget and the bytes per token."""

    bytes_per_token: int
    budget_bytes: int = 0  # 0: take the capacity the frontend reports (blocks x block size)

    def tokens(self, reported_tokens: int) -> int:
        if self.budget_bytes > 0 and self.bytes_per_token > 0:
            return self.budget_bytes // self.bytes_per_token
        return reported_tokens


@dataclass(frozen=True)
class WorkerStats:
    role: str
    url: str
    kv_usage: float
    running: int
    waiting: int
    itl_s: float | None  # mean over the window since the previous scrape
    itl_n: int
    ttft_s: float | None
    ttft_n: int
    preempted: int


@dataclass(frozen=True)
class PoolStats:
    """One resource: the prefill pool or the decode pool (aggregated workers are in both)."""

    role: str
    workers: int
    kv_usage_max: float
    kv_usage_mean: float
    running: int
    waiting: int
    itl_s: float | None
    ttft_s: float | None


@dataclass(frozen=True)
class FrontendStats:
    inflight: int
    queued: int
    itl_s: float | None
    ttft_s: float | None
    active_decode_blocks: int
    active_prefill_tokens: int
    kv_tokens_per_worker: int  # total blocks x block size, as the frontend reports them
    max_num_seqs: int
    rejected: int  # admission rejections since the previous scrape
    streaming: int  # streamed requests in flight
    stream_arrivals: int  # streamed requests started since the previous scrape
    # The window's TTFT at `FleetTelemetry.ttft_quantile`, from the histogram's buckets (None:
    # no buckets, or no first token in the window): the SLO bounds each request's TTFT, and the
    # tail moves before the mean does.
    ttft_tail_s: float | None = None


@dataclass(frozen=True)
class FleetSnapshot:
    at: float  # time.monotonic() of the scrape
    frontend: FrontendStats | None
    workers: tuple[WorkerStats, ...]
    missing: tuple[str, ...]  # endpoints that did not answer

    @property
    def complete(self) -> bool:
        # Worker endpoints are optional (a frontend alone gives latency, in-flight and queue
        # figures); an endpoint that is configured but does not answer makes it incomplete.
        return not self.missing and self.frontend is not None

    def pool(self, role: str) -> PoolStats | None:
        """`decode`: agg + decode workers; `prefill`: prefill workers, else the agg ones."""
        if role == "decode":
            members = [w for w in self.workers if w.role in ("agg", "decode")]
        else:
            members = [w for w in self.workers if w.role == "prefill"] or [w for w in self.workers if w.role == "agg"]
        if not members:
            return None
        return PoolStats(
            role=role,
            workers=len(members),
            kv_usage_max=max(w.kv_usage for w in members),
            kv_usage_mean=sum(w.kv_usage for w in members) / len(members),
            running=sum(w.running for w in members),
            waiting=sum(w.waiting for w in members),
            itl_s=_weighted(((w.itl_s, w.itl_n) for w in members), worst=True),
            ttft_s=_weighted(((w.ttft_s, w.ttft_n) for w in members), worst=True),
        )


def _weighted(pairs: Iterable[tuple[float | None, int]], *, worst: bool) -> float | None:
    """The worst worker's window mean (an interactive request lives on one worker)."""
    values = [v for v, n in pairs if v is not None and n > 0]
    if not values:
        return None
    return max(values) if worst else sum(values) / len(values)


@dataclass
class _Counter:
    """A cumulative sum/count pair turned into a per-window mean."""

    last_sum: float | None = None
    last_count: float | None = None

    def window(self, s: float | None, c: float | None) -> tuple[float | None, int]:
        if s is None or c is None:
            return None, 0
        prev_s, prev_c = self.last_sum, self.last_count
        self.last_sum, self.last_count = s, c
        if prev_s is None or prev_c is None or c < prev_c:  # first scrape, or the process restarted
            return None, 0
        n = int(c - prev_c)
        return ((s - prev_s) / n if n > 0 else None), n


def _le(labels: str) -> float | None:
    """The `le` bound of a bucket sample's labels."""
    at = labels.find('le="')
    if at < 0:
        return None
    end = labels.find('"', at + 4)
    try:
        return float(labels[at + 4 : end])
    except ValueError:
        return None


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a histogram's cumulative (le, count) buckets, sorted by le, as
    Prometheus' histogram_quantile gives it: linear within the bucket it falls in; the highest
    finite bound when it falls in the +Inf bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 1.0)
        prev_le, prev_n = le, n
    return prev_le


@dataclass
class _Buckets:
    """A cumulative histogram's buckets turned into the window's buckets since the last scrape."""

    last: dict[float, float] | None = None

    def window(self, samples: list[tuple[str, float]] | None) -> list[tuple[float, float]]:
        if not samples:
            return []
        now: dict[float, float] = {}
        for labels, v in samples:
            le = _le(labels)
            if le is not None:
                now[le] = now.get(le, 0.0) + v  # summed over the series' other labels
        prev, self.last = self.last, now
        if prev is None or any(now[le] < prev.get(le, 0.0) for le in now):  # first scrape, or a restart
            return []
        return sorted((le, now[le] - prev.get(le, 0.0)) for le in now)


@dataclass
class FleetTelemetry:
    """Scrapes one deployment. Not thread-safe: one controller owns one instance."""

    endpoints: list[MetricsEndpoint]
    timeout_s: float = 0.5
    _client: httpx.Client | None = None
    _windows: dict[tuple[str, str], _Counter] = field(default_factory=dict)
    _last_rejected: float | None = None
    _last_stream_started: float | None = None
    _last_preempted: dict[str, float] = field(default_factory=dict)
    # Where a scrape's time comes from: the simulator (`backfill.sim`) runs on a virtual clock.
    clock: Callable[[], float] = time.monotonic
    # One model of a deployment that serves several: the frontend's series labelled with another
    # model are left out (the endpoints list that model's workers only).
    model: str | None = None
    # The TTFT quantile the frontend's histogram is read at (`FrontendStats.ttft_tail_s`).
    ttft_quantile: float = 0.9
    _ttft_buckets: _Buckets = field(default_factory=_Buckets)

    def _get(self, url: str) -> str | None:
        if self._client is None:
            self._client = httpx.Client(timeout=httpx.Timeout(self.timeout_s))
        try:
            resp = self._client.get(url)
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    def _window(self, url: str, metric: str, samples: dict[str, list[tuple[str, float]]]) -> tuple[float | None, int]:
        counter = self._windows.setdefault((url, metric), _Counter())
        return counter.window(_total(samples, f"{metric}_sum"), _total(samples, f"{metric}_count"))

    def scrape(self) -> FleetSnapshot:
        at = self.clock()
        missing: list[str] = []
        frontend: FrontendStats | None = None
        workers: list[WorkerStats] = []
        for ep in self.endpoints:
            text = self._get(ep.url)
            if text is None:
                missing.append(ep.url)
                continue
            if ep.role == "frontend":
                frontend = self._frontend(ep.url, text if self.model is None else only_model(text, self.model))
            else:
                workers.append(self._worker(ep, text))
        return FleetSnapshot(at=at, frontend=frontend, workers=tuple(workers), missing=tuple(missing))

    def _frontend(self, url: str, text: str) -> FrontendStats:
        s = parse_prometheus(text, _FRONTEND_NAMES)
        itl, _ = self._window(url, F_ITL, s)
        ttft, _ = self._window(url, F_TTFT, s)
        ttft_tail = bucket_quantile(self._ttft_buckets.window(s.get(F_TTFT_BUCKET)), self.ttft_quantile)
        rejected_total = _total(s, F_REJECTED) or 0.0
        rejected = 0 if self._last_rejected is None else max(0, int(rejected_total - self._last_rejected))
        self._last_rejected = rejected_total
        started = sum(v for labels, v in s.get(F_STARTED, []) if STREAM_LABEL in labels)
        finished = sum(v for labels, v in s.get(F_FINISHED, []) if STREAM_LABEL in labels)
        prev_started, self._last_stream_started = self._last_stream_started, started
        blocks = _max(s, F_TOTAL_BLOCKS) or 0.0
        block_size = _max(s, F_BLOCK_SIZE) or 0.0
        return FrontendStats(
            inflight=int(_total(s, F_INFLIGHT) or 0),
            queued=int(_total(s, F_QUEUED) or 0),
            itl_s=itl,
            ttft_s=ttft,
            active_decode_blocks=int(_total(s, F_DECODE_BLOCKS) or 0),
            active_prefill_tokens=int(_total(s, F_PREFILL_TOKENS) or 0),
            kv_tokens_per_worker=int(blocks * block_size),
            max_num_seqs=int(_max(s, F_MAX_SEQS) or 0),
            rejected=rejected,
            streaming=max(0, int(started - finished)),
            stream_arrivals=0 if prev_started is None else max(0, int(started - prev_started)),
            ttft_tail_s=ttft_tail,
        )

    def _worker(self, ep: MetricsEndpoint, text: str) -> WorkerStats:
        s = parse_prometheus(text, _WORKER_NAMES)
        itl, itl_n = self._window(ep.url, W_ITL, s)
        ttft, ttft_n = self._window(ep.url, W_TTFT, s)
        pre_total = _total(s, PREEMPTIONS) or 0.0
        prev = self._last_preempted.get(ep.url)
        self._last_preempted[ep.url] = pre_total
        return WorkerStats(
            role=ep.role,
            url=ep.url,
            kv_usage=_max(s, KV_USAGE) or 0.0,
            running=int(_total(s, RUNNING) or 0),
            waiting=int(_total(s, WAITING) or 0),
            itl_s=itl,
            itl_n=itl_n,
            ttft_s=ttft,
            ttft_n=ttft_n,
            preempted=0 if prev is None else max(0, int(pre_total - prev)),
        )

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
