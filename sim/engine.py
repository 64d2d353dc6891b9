"""The simulated fleet: workers with vLLM's scheduler, a KV-aware frontend, the metrics they serve.

Time is virtual (`Clock`): every worker step, KV transfer, arrival and control tick is an event
on one heap, so a two-minute trace runs in a fraction of a second and every run is repeatable.

A worker models what the capacity controller steers on (vLLM v1's scheduler, simplified where it
does not matter to latency):
- continuous batching: each step decodes one token of every running sequence and prefills up to
  `max_num_batched_tokens` (minus the decodes) of prompts, chunked, running ones first;
- at most `max_num_seqs` running; new requests by priority (interactive before batch) when
  `priority` is on, else in arrival order;
- KV in blocks of `block_size` tokens; capacity from the byte budget and the bytes per token;
  when a decode token finds no block the newest lowest-priority sequence is preempted (its KV
  freed, recomputed later), and an interactive arrival may preempt batch work to get in;
- a prefix cache in the free blocks (LRU), evicted blocks kept in a host-memory tier when one is
  configured and loaded back at a per-token cost instead of recomputed;
- step time from what the step holds (`backfill.sim.perf`).
A split fleet prefills on its prefill workers and ships the KV (per-token transfer time) to a
decode worker; an aggregated one does both on every worker. The frontend routes as Dynamo's KV
router does: the worker with the fewest blocks to prefill plus blocks already active.

Decoding sequences are advanced lazily (a running sum and a heap of finishing steps), so a step
costs O(prefill chunks + finishing sequences), not O(running sequences).
"""

from __future__ import annotations

import heapq
import json
import math
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from backfill.sim.perf import MockerPerf, Perf, TablePerf

FLEETS = Path(__file__).resolve().parent / "fleets"


@dataclass(frozen=True)
class FleetSpec:
    name: str = "mocker-disagg"
    mode: str = "disagg"  # or "agg"
    prefill_workers: int = 1  # split fleet only
    decode_workers: int = 2  # the aggregated fleet's workers
    block_size: int = 16
    kv_budget_bytes: int = 2048 * 64 * 576
    kv_bytes_per_token: int = 576  # FP8 MLA row; 352 for NVFP4
    kv_extra_bytes_per_token: int = 0  # beside the KV row (e.g. a sparse-attention indexer key)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    perf: str = "mocker"  # or a table file in sim/fleets (`backfill.sim.aic_table`)
    perf_scale: float = 1.0
    decode_tokens_per_step: float = 1.0  # speculative decoding's mean accepted tokens per step (table perf)
    speedup_ratio: float = 1.0
    # Mocker perf only: the host's work per decode step and per sequence in it (see MockerPerf).
    decode_step_overhead_ms: float = 0.0
    decode_ms_per_seq: float = 0.0
    priority: bool = False
    kv_transfer_latency_s: float = 0.002
    kv_transfer_s_per_token: float = 0.0
    host_kv_tokens: int = 0  # host-memory tier per worker (0: none)
    # One host tier the whole fleet shares (Mooncake store, LMCache with a shared backend): each
    # prompt's KV is written there as it is computed, so any worker loads it instead of
    # recomputing; its size is host_kv_tokens x workers. False: a private tier per worker,
    # filled by what the device cache evicts.
    host_kv_shared: bool = False
    host_load_s_per_token: float = 0.0
    frontend_s: float = 0.001  # frontend + router time before a request reaches a worker
    gpus_per_worker: int = 1
    # The batch work backfill releases: lines under a few shared preambles (one per group).
    batch_groups: int = 8
    batch_preamble: int = 450
    batch_unique: tuple[int, int] = (200, 400)
    batch_output: tuple[int, int] = (128, 384)
    # The capacity controller's settings for this fleet (`ControlConfig` fields), as an operator
    # would set them: e.g. the prefill engines' occupancy target, which depends on how long a
    # prefill takes against the TTFT SLO. (Pairs, so the spec stays hashable.)
    control: tuple[tuple[str, float], ...] = ()

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> FleetSpec:
        p = Path(path)
        if not p.exists() and (FLEETS / f"{path}.json").exists():
            p = FLEETS / f"{path}.json"
        data = json.loads(p.read_text())
        data.pop("comment", None)
        for k in ("batch_unique", "batch_output"):
            if k in data:
                data[k] = tuple(data[k])
        if "control" in data:
            items = data["control"].items() if isinstance(data["control"], dict) else data["control"]
            data["control"] = tuple(sorted((str(k), v) for k, v in items))
        return replace(cls(**data), **{k: v for k, v in overrides.items() if v is not None})

    def with_kv(self, bytes_per_token: int) -> FleetSpec:
        return replace(self, kv_bytes_per_token=bytes_per_token)

    @property
    def kv_tokens(self) -> int:
        per = self.kv_bytes_per_token + self.kv_extra_bytes_per_token
        blocks = self.kv_budget_bytes // (per * self.block_size)
        return int(blocks * self.block_size)

    def make_perf(self) -> Perf:
        if self.perf == "mocker":
            return MockerPerf(self.speedup_ratio, self.decode_step_overhead_ms, self.decode_ms_per_seq)
        return TablePerf.load(FLEETS / self.perf, self.perf_scale, self.decode_tokens_per_step)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Req:
    """One request: an interactive turn or a batch line."""

    __slots__ = (
        "after",
        "arrival",
        "chain",
        "computed",
        "ctx0",
        "dec_step0",
        "done_at",
        "epoch",
        "finish_store",
        "first_at",
        "gen_base",
        "generated",
        "interactive",
        "line",
        "max_tokens",
        "need",
        "prefill_store",
        "priority",
        "prompt",
        "rid",
        "session",
        "shared",
        "state",
        "todo",
        "transferred",
        "turn",
        "worker",
        "wstart",
    )

    def __init__(
        self,
        rid: int,
        *,
        interactive: bool,
        prompt: int,
        max_tokens: int,
        chain: tuple[tuple[str, int], ...] = (),
        prefill_store: tuple[tuple[str, int], ...] = (),
        finish_store: tuple[tuple[str, int], ...] = (),
        shared: tuple[str, int] | None = None,
    ) -> None:
        self.rid = rid
        self.interactive = interactive
        self.priority = 0 if interactive else 1
        self.prompt = prompt
        self.max_tokens = max(1, max_tokens)
        self.chain = chain  # cacheable prefixes of the prompt, longest first: (key, tokens)
        self.prefill_store = prefill_store  # what the prefix cache holds once the prompt is in
        self.finish_store = finish_store  # and once the reply is (a session's next turn extends it)
        self.shared = shared  # a prefix running requests share blocks of (system prompt, batch preamble)
        self.arrival = 0.0
        self.wstart = 0.0
        self.need = prompt  # tokens to hold before decoding: the prompt (+ output, after a preemption)
        self.computed = 0
        self.generated = 0
        self.gen_base = 0
        self.ctx0 = 0
        self.dec_step0 = 0
        self.epoch = 0
        self.first_at: float | None = None
        self.done_at: float | None = None
        self.state = "new"  # new | waiting | prefill | decode | transfer | done | aborted
        self.worker = -1
        self.transferred = False
        self.todo = prompt  # tokens to prefill where it was routed (the router's estimate)
        self.session = -1
        self.turn = -1
        self.line = -1
        self.after = None


class Clock:
    """The event heap: (time, order, bound method, args). A bound method pickles as its object
    and its name, so a whole simulation pickles (the oracle snapshots it)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[tuple[float, int, Any, tuple[Any, ...]]] = []
        self.n = 0
        self.targets: dict[str, Any] = {}
        # The end of the running `run_until`: a worker may run its next step in place of an
        # event only up to there (and only while that step ends before every queued event).
        self.until = -math.inf

    def at(self, t: float, target: str, method: str, *args: Any) -> None:
        self.n += 1
        heapq.heappush(self.heap, (t, self.n, getattr(self.targets[target], method), args))

    def call_at(self, t: float, fn: Any, *args: Any) -> None:
        self.n += 1
        heapq.heappush(self.heap, (t, self.n, fn, args))

    def run_until(self, t_end: float) -> None:
        heap = self.heap
        pop = heapq.heappop
        self.until = t_end
        while heap and heap[0][0] <= t_end:
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
        self.until = -math.inf
        if self.now < t_end:
            self.now = t_end


@dataclass
class WorkerMetrics:
    itl_sum: float = 0.0
    itl_count: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    preemptions: int = 0


class HostTier:
    """Prefix KV kept in host memory, LRU, by prefix key."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.tokens = 0

    def put(self, key: str, n: int) -> None:
        old = self.entries.pop(key, 0)
        self.entries[key] = max(old, n)
        self.tokens += self.entries[key] - old
        while self.entries and self.tokens > self.capacity:
            _, m = self.entries.popitem(last=False)
            self.tokens -= m


class Worker:
    def __init__(
        self, index: int, role: str, spec: FleetSpec, perf: Perf, fleet: Fleet, host: HostTier | None = None
    ) -> None:
        self.index = index
        self.role = role
        self.spec = spec
        self.perf = perf
        self.fleet = fleet
        self.capacity = spec.kv_tokens
        self.half_block = spec.block_size // 2
        self.waiting: list[Req] = []
        self.prefilling: list[Req] = []
        self.decoding: dict[int, Req] = {}
        self.finishing: list[tuple[int, int, int, Req]] = []  # (finish step, rid, epoch, req)
        self.step_no = 0
        self.busy = False
        self.dec_offset = 0  # sum over decoding of (ctx0 - dec_step0): their tokens = this + n * step_no
        self.pre_tokens = 0
        self.shared_refs: dict[str, int] = {}
        self.shared_saving = 0
        self.cache: OrderedDict[str, int] = OrderedDict()
        self.cache_tokens = 0
        self.host = host if host is not None else HostTier(spec.host_kv_tokens)
        self.m = WorkerMetrics()
        self.step_chunks: list[tuple[Req, int]] = []
        self.step_started = 0.0
        self.step_ndec = 0
        self.name = f"w{index}"  # its target name on the clock

    # -- KV accounting ---------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def active_tokens(self) -> int:
        n = len(self.decoding)
        held = self.dec_offset + n * self.step_no + self.pre_tokens - self.shared_saving
        return held + (n + len(self.prefilling)) * self.half_block  # blocks are allocated whole

    def usage(self) -> float:
        return min(1.0, self.active_tokens() / self.capacity) if self.capacity else 0.0

    def _share(self, r: Req, sign: int) -> None:
        if r.shared is None:
            return
        key, n = r.shared
        refs = self.shared_refs.get(key, 0)
        if sign > 0:
            if refs >= 1:
                self.shared_saving += min(n, r.need)
            self.shared_refs[key] = refs + 1
        else:
            if refs >= 2:
                self.shared_saving -= min(n, r.need)
            if refs <= 1:
                self.shared_refs.pop(key, None)
            else:
                self.shared_refs[key] = refs - 1

    def hit(self, r: Req) -> tuple[int, int]:
        """Prompt tokens found in the device cache, and (beyond those) in the host tier."""
        device = host = 0
        for key, n in r.chain:
            got = self.cache.get(key)
            if got:
                device = min(n, got)
                break
        for key, n in r.chain:
            got = self.host.entries.get(key)
            if got:
                host = max(0, min(n, got) - device)
                break
        return min(device, r.need - 1), max(0, min(host, r.need - 1 - device))

    def store(self, items: tuple[tuple[str, int], ...]) -> None:
        shared = self.spec.host_kv_shared and self.spec.host_kv_tokens
        for key, n in items:
            old = self.cache.pop(key, 0)
            self.cache[key] = max(old, n)
            self.cache_tokens += self.cache[key] - old
            if shared:
                self.host.put(key, n)

    def trim_cache(self) -> None:
        if not self.cache_tokens:
            return
        room = self.capacity - self.active_tokens()
        while self.cache and self.cache_tokens > room:
            key, n = self.cache.popitem(last=False)
            self.cache_tokens -= n
            if self.spec.host_kv_tokens:
                self.host.put(key, n)

    # -- scheduling ------------------------------------------------------------------------
    def enqueue(self, r: Req) -> None:
        r.state = "waiting"
        r.worker = self.index
        r.wstart = self.fleet.clock.now
        self.waiting.append(r)
        self.kick()

    def kick(self) -> None:
        if not self.busy and (self.waiting or self.prefilling or self.decoding):
            self.start_step()

    def _victim(self) -> Req | None:
        pool = list(self.decoding.values()) + self.prefilling
        if not pool:
            return None
        if self.spec.priority:
            return max(pool, key=lambda r: (r.priority, r.arrival))
        return max(pool, key=lambda r: r.arrival)

    def preempt(self, r: Req) -> None:
        self.m.preemptions += 1
        self._drop(r)
        r.need = r.prompt + r.generated
        r.computed = 0
        r.state = "waiting"
        r.transferred = False
        self.waiting.insert(0, r)

    def _drop(self, r: Req) -> None:
        """Takes a running request off this worker, its KV freed."""
        if r.state == "decode":
            r.generated = r.gen_base + (self.step_no - r.dec_step0)
            del self.decoding[r.rid]
            self.dec_offset -= r.ctx0 - r.dec_step0
            r.epoch += 1
        elif r.state == "prefill":
            self.prefilling.remove(r)
            self.pre_tokens -= r.computed
        self._share(r, -1)

    def abort(self, r: Req) -> None:
        if r.state == "waiting":
            self.waiting.remove(r)
        elif r.state in ("decode", "prefill"):
            self._drop(r)
            for i, (c, _) in enumerate(self.step_chunks):
                if c is r:
                    self.step_chunks[i] = (c, -1)
        r.state = "aborted"

    def start_step(self, in_place: bool = False) -> float | None:
        """Starts the next step and queues its end. With `in_place` (from `end_step`), a step
        that ends before every queued event and within the running `run_until` is not queued:
        its end time is returned and the caller runs it at once, as the clock would have."""
        spec = self.spec
        clock = self.fleet.clock
        now = clock.now
        n_dec = len(self.decoding)
        if not self.waiting and not self.prefilling:
            # Most steps only decode: the same step as below, without the prefill bookkeeping.
            if not n_dec:
                self.busy = False
                return None
            tokens = self.dec_offset + n_dec * self.step_no
            held = tokens + self.pre_tokens - self.shared_saving + n_dec * self.half_block
            capacity = self.capacity
            if held + n_dec <= capacity:
                usage = min(1.0, held / capacity)
                decode_ms = self.perf.decode_ms(n_dec, tokens / n_dec, usage)
                self.busy = True
                if self.step_chunks:
                    self.step_chunks = []
                self.step_ndec = n_dec
                self.step_started = now
                t = now + max(decode_ms / 1000.0, 1e-4)
                if in_place and t <= clock.until:
                    heap = clock.heap
                    if not heap or t < heap[0][0]:
                        return t
                clock.call_at(t, self.end_step)
                return None
        # Decode tokens need blocks: preempt until they fit.
        while n_dec and self.active_tokens() + n_dec > self.capacity:
            v = self._victim()
            if v is None:
                break
            self.preempt(v)
            n_dec = len(self.decoding)
        budget = spec.max_num_batched_tokens - n_dec
        chunks: list[tuple[Req, int]] = []
        prefill_ms = 0.0
        free = self.capacity - self.active_tokens() - n_dec
        for r in self.prefilling:
            if budget <= 0:
                break
            c = min(r.need - r.computed, budget, max(0, free))
            if c <= 0:
                continue
            chunks.append((r, c))
            budget -= c
            free -= c
        load_s = 0.0
        if self.waiting and budget > 0:
            order = sorted(self.waiting, key=lambda r: (r.priority, r.wstart)) if spec.priority else list(self.waiting)
            for r in order:
                if self.running >= spec.max_num_seqs or budget <= 0:
                    break
                if r.transferred:
                    new, dev, host = 0, r.need, 0
                else:
                    dev, host = self.hit(r)
                    new = r.need - dev - host
                c = min(new, budget)
                want = dev + host + c + self.half_block
                if want > free and spec.priority and r.interactive:
                    # An interactive request may take the blocks of running batch work.
                    while want > free:
                        v = self._victim()
                        if v is None or v.interactive:
                            break
                        self.preempt(v)
                        free = self.capacity - self.active_tokens() - len(self.decoding)
                if want > free:
                    break  # head of line: vLLM does not skip a request that does not fit
                self.waiting.remove(r)
                r.state = "prefill"
                r.computed = dev + host
                self.pre_tokens += r.computed
                self.prefilling.append(r)
                self._share(r, +1)
                if host:
                    load_s += host * spec.host_load_s_per_token
                chunks.append((r, c))
                budget -= c
                free -= want
        n_new_dec = 0
        for r, c in chunks:
            if c > 0 and self.role != "decode":
                prefill_ms += self.perf.prefill_ms(c, r.computed) if isinstance(self.perf, MockerPerf) else 0.0
            elif c == 0:
                n_new_dec += 1
        if not isinstance(self.perf, MockerPerf) and self.role != "decode":
            tot = sum(c for _, c in chunks if c > 0)
            if tot:
                pre = sum(r.computed for r, c in chunks if c > 0) / max(1, sum(1 for _, c in chunks if c > 0))
                prefill_ms = self.perf.prefill_ms(tot, int(pre))
        decode_n = n_dec + n_new_dec
        decode_ms = 0.0
        if decode_n:
            ctx = (self.dec_offset + n_dec * self.step_no) / n_dec if n_dec else float(chunks[0][0].need)
            decode_ms = self.perf.decode_ms(decode_n, ctx, self.usage())
        dur = (prefill_ms + decode_ms) / 1000.0 + load_s
        if not chunks and not n_dec:
            self.busy = False
            return None
        self.busy = True
        self.step_chunks = chunks
        self.step_ndec = n_dec
        self.step_started = now
        clock.call_at(now + max(dur, 1e-4), self.end_step)
        return None

    def end_step(self) -> None:
        fleet = self.fleet
        clock = fleet.clock
        while True:
            now = clock.now
            dur = now - self.step_started
            self.step_no += 1
            step = self.step_no
            n_dec = self.step_ndec
            if n_dec:
                self.m.itl_sum += dur * n_dec
                self.m.itl_count += n_dec
            fin = self.finishing
            while fin and fin[0][0] <= step:
                _, _, epoch, r = heapq.heappop(fin)
                if r.epoch != epoch or r.state != "decode":
                    continue
                del self.decoding[r.rid]
                self.dec_offset -= r.ctx0 - r.dec_step0
                self._share(r, -1)
                r.generated = r.max_tokens
                r.state = "done"
                r.done_at = now
                self.store(r.finish_store)
                fleet.finished(r)
            for r, c in self.step_chunks if self.step_chunks else ():
                if c < 0 or r.state != "prefill":
                    continue
                r.computed += c
                self.pre_tokens += c
                if r.computed < r.need:
                    continue
                self.prefilling.remove(r)
                self.pre_tokens -= r.computed
                self.store(r.prefill_store)
                if self.role == "prefill":
                    self._share(r, -1)
                    r.state = "transfer"
                    fleet.transfer(r, self)
                    continue
                # The prompt is in: this step sampled the next token.
                if r.first_at is None:
                    r.first_at = now
                    self.m.ttft_sum += now - r.wstart
                    self.m.ttft_count += 1
                    fleet.first_token(r)
                r.generated += 1
                if r.generated >= r.max_tokens:
                    self._share(r, -1)
                    r.state = "done"
                    r.done_at = now
                    self.store(r.finish_store)
                    fleet.finished(r)
                    continue
                r.state = "decode"
                r.gen_base = r.generated
                r.ctx0 = r.need + 1
                r.dec_step0 = step
                r.transferred = False
                self.decoding[r.rid] = r
                self.dec_offset += r.ctx0 - step
                heapq.heappush(fin, (step + r.max_tokens - r.gen_base, r.rid, r.epoch, r))
            if self.step_chunks:
                self.step_chunks = []
            if self.cache_tokens:
                self.trim_cache()
            self.busy = False
            if not (self.waiting or self.prefilling or self.decoding):
                return
            # The next step, run here while it ends before anything else is due.
            t = self.start_step(in_place=True)
            if t is None:
                return
            clock.now = t

    def metrics_text(self) -> str:
        m = self.m
        return (
            f"vllm:kv_cache_usage_perc {self.usage():.6f}\n"
            f"vllm:num_requests_running {self.running}\n"
            f"vllm:num_requests_waiting {len(self.waiting)}\n"
            f"vllm:num_preemptions_total {m.preemptions}\n"
            f"vllm:inter_token_latency_seconds_sum {m.itl_sum:.6f}\n"
            f"vllm:inter_token_latency_seconds_count {m.itl_count}\n"
            f"vllm:time_to_first_token_seconds_sum {m.ttft_sum:.6f}\n"
            f"vllm:time_to_first_token_seconds_count {m.ttft_count}\n"
        )


# The frontend's TTFT histogram bounds: Dynamo's defaults (lib/llm/src/http/service/metrics.rs,
# `DYN_METRICS_TTFT_{MIN,MAX,COUNT}` = 0.001, 480, 18: 0 then log-spaced, two significant figures).
TTFT_BUCKETS = (
    0.0, 0.0022, 0.0047, 0.01, 0.022, 0.047, 0.1, 0.22, 0.47, 1.0, 2.2, 4.7, 10.0, 22.0, 48.0, 100.0,
    220.0, 480.0,
)  # fmt: skip


@dataclass
class FrontendMetrics:
    itl_sum: float = 0.0
    itl_count: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    # First tokens per bucket of TTFT_BUCKETS (the last one: above them all), not cumulative.
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    started: dict[str, int] = field(default_factory=lambda: {"stream": 0, "unary": 0})
    finished: dict[str, int] = field(default_factory=lambda: {"stream": 0, "unary": 0})


class Fleet:
    """The frontend and its workers. Reports finished requests to `sink.request_done(req)`."""

    def __init__(self, spec: FleetSpec, clock: Clock, sink_name: str) -> None:
        self.spec = spec
        self.clock = clock
        self.sink_name = sink_name
        self.perf = spec.make_perf()
        self.workers: list[Worker] = []
        n = (spec.prefill_workers if spec.mode == "disagg" else 0) + spec.decode_workers
        tier = HostTier(spec.host_kv_tokens * n) if spec.host_kv_shared else None
        if spec.mode == "disagg":
            for _ in range(spec.prefill_workers):
                self.workers.append(Worker(len(self.workers), "prefill", spec, self.perf, self, tier))
        for _ in range(spec.decode_workers):
            role = "decode" if spec.mode == "disagg" else "agg"
            self.workers.append(Worker(len(self.workers), role, spec, self.perf, self, tier))
        for w in self.workers:
            clock.targets[self.name_of(w)] = w
        clock.targets["fleet"] = self
        self.inflight: dict[int, Req] = {}
        self.m = FrontendMetrics()
        self.urls = {"frontend": "sim://frontend"} | {f"w{w.index}": f"sim://w{w.index}" for w in self.workers}

    @staticmethod
    def name_of(w: Worker) -> str:
        return w.name

    @property
    def prefillers(self) -> list[Worker]:
        return [w for w in self.workers if w.role in ("prefill", "agg")]

    @property
    def decoders(self) -> list[Worker]:
        return [w for w in self.workers if w.role in ("decode", "agg")]

    def submit(self, r: Req) -> None:
        r.arrival = self.clock.now
        r.state = "new"
        self.inflight[r.rid] = r
        self.m.started["stream" if r.interactive else "unary"] += 1
        self.clock.call_at(self.clock.now + self.spec.frontend_s, self.route, r)

    def route(self, r: Req) -> None:
        if r.state == "aborted":
            return
        bs = self.spec.block_size

        def cost(w: Worker) -> float:
            # Blocks to prefill here, plus the prefill already queued here, plus the blocks in use.
            dev, host = w.hit(r)
            queued = sum(x.need - x.computed for x in w.prefilling) + sum(x.todo for x in w.waiting)
            return (r.need - dev - host + queued + w.active_tokens()) / bs

        best = min(self.prefillers, key=lambda w: (cost(w), (w.index + r.rid) % len(self.workers)))
        dev, host = best.hit(r)
        r.todo = r.need - dev - host
        best.enqueue(r)

    def transfer(self, r: Req, src: Worker) -> None:
        dst = min(self.decoders, key=lambda w: (w.active_tokens() + sum(x.need for x in w.waiting), w.index))
        dt = self.spec.kv_transfer_latency_s + r.need * self.spec.kv_transfer_s_per_token
        self.clock.call_at(self.clock.now + dt, self.arrive, r, dst.index)

    def arrive(self, r: Req, dst: int) -> None:
        if r.state == "aborted":
            return
        r.transferred = True
        r.computed = 0
        self.workers[dst].enqueue(r)

    def first_token(self, r: Req) -> None:
        ttft = self.clock.now - r.arrival
        self.m.ttft_sum += ttft
        self.m.ttft_count += 1
        self.m.ttft_buckets[bisect_left(TTFT_BUCKETS, ttft)] += 1

    def finished(self, r: Req) -> None:
        self.inflight.pop(r.rid, None)
        self.m.finished["stream" if r.interactive else "unary"] += 1
        if r.max_tokens > 1 and r.first_at is not None and r.done_at is not None:
            self.m.itl_sum += r.done_at - r.first_at
            self.m.itl_count += r.max_tokens - 1
        self.clock.targets[self.sink_name].request_done(r)

    def abort(self, r: Req) -> None:
        if r.rid not in self.inflight:
            return
        del self.inflight[r.rid]
        self.m.finished["stream" if r.interactive else "unary"] += 1
        if r.worker >= 0 and r.state in ("waiting", "prefill", "decode"):
            w = self.workers[r.worker]
            w.abort(r)
        r.state = "aborted"

    def metrics_text(self, url: str) -> str:
        if url != self.urls["frontend"]:
            return self.workers[int(url.rsplit("w", 1)[1])].metrics_text()
        m, spec = self.m, self.spec
        lines = [
            f"dynamo_frontend_inflight_requests {len(self.inflight)}",
            "dynamo_frontend_queued_requests 0",
            f"dynamo_frontend_inter_token_latency_seconds_sum {m.itl_sum:.6f}",
            f"dynamo_frontend_inter_token_latency_seconds_count {m.itl_count}",
            f"dynamo_frontend_time_to_first_token_seconds_sum {m.ttft_sum:.6f}",
            f"dynamo_frontend_time_to_first_token_seconds_count {m.ttft_count}",
            f"dynamo_frontend_model_total_kv_blocks {spec.kv_tokens // spec.block_size}",
            f"dynamo_frontend_model_kv_cache_block_size {spec.block_size}",
            f"dynamo_frontend_model_max_num_seqs {spec.max_num_seqs}",
            "dynamo_frontend_router_admission_rejected_total 0",
        ]
        cumulative = 0
        for le, n in zip((*TTFT_BUCKETS, "+Inf"), m.ttft_buckets, strict=True):
            cumulative += n
            lines.append(f'dynamo_frontend_time_to_first_token_seconds_bucket{{le="{le}"}} {cumulative}')
        for w in self.workers:
            lines.append(
                f'dynamo_frontend_worker_active_decode_blocks{{worker="{w.index}"}} {w.active_tokens() // spec.block_size}'
            )
            lines.append(
                f'dynamo_frontend_worker_active_prefill_tokens{{worker="{w.index}"}} '
                f"{sum(r.need - r.computed for r in w.prefilling) + sum(r.need for r in w.waiting)}"
            )
        for kind in ("stream", "unary"):
            lines.append(f'dynamo_frontend_requests_started_total{{request_type="{kind}"}} {m.started[kind]}')
            lines.append(f'dynamo_frontend_requests_total{{request_type="{kind}"}} {m.finished[kind]}')
        return "\n".join(lines) + "\n"
