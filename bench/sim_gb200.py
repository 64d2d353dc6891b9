"""The GB200 GLM-5.3 fleet in the simulator against the operator's published figures.

Published (GLM-5.3 NVFP4 on GB200 NVL72, agent workload): 1 prefill : 4 decode groups serving 66
concurrent agent sessions per prefill group at about 101 output tokens/s per user; NVFP4 KV rows
(352 B instead of 576 B) raise the cached tokens per decoder from about 1.09M to 1.63M.

This runs 66 agent sessions under way at once (each turn adds ~6K tokens to a prompt of up to
140K, most of it cached: the `glm_agent` trace's turns, without its waves) interactive only on `sim/fleets/gb200-glm53.json` and prints the
simulator's figure beside each published one (within 15%: ok).

    .venv/bin/python -m bench.sim_gb200 [--fleet gb200-glm53] [--seeds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics

from backfill.sim.control import Policy, Sim, SloRule
from backfill.sim.engine import FleetSpec
from backfill.sim.workload import Session, Trace, Turn
from bench.harvest_results import pct


def steady_agents(seed: int, sessions: int = 66, duration_s: float = 120.0) -> Trace:
    """`sessions` agents under way the whole time (the published operating point), closed loop:
    each turn adds ~6K tokens (lognormal) to the conversation, up to 140K, replies of 300-900
    tokens, 2-6 s of tool time between turns; starts spread over the first 10 s."""
    rng = random.Random(seed * 7717 + 13)
    out = []
    for _ in range(sessions):
        turns, context = [], 0
        while context < 140_000:
            add = int(min(20_000, max(500, rng.lognormvariate(8.7, 0.4))))  # median ~6K
            out_tokens = rng.randint(300, 900)
            turns.append(Turn(add, out_tokens, rng.uniform(2.0, 6.0)))
            context += add + out_tokens
        out.append(Session(rng.uniform(0.0, 10.0), tuple(turns)))
    return Trace("glm_agent_steady", duration_s, 4000, tuple(sorted(out, key=lambda s: s.start_s)))


PUBLISHED = {"sessions": 66.0, "tok_s_user": 101.0, "kv_fp8": 1.09e6, "kv_nvfp4": 1.63e6}


def measure(spec: FleetSpec, seed: int) -> dict[str, float]:
    trace = steady_agents(seed)
    sim = Sim(spec, trace, Policy("none"), slo=SloRule(1e9, 1e9), seed=seed)
    live: list[int] = []
    batch: list[float] = []
    step = 1.0
    t = 0.0
    while t < trace.duration_s:
        t += step
        sim.run_until(t)
        # Sessions under way: started, with a turn in flight or thinking before the next one.
        started = {i for i, s in enumerate(trace.sessions) if s.start_s <= t}
        finished = {
            r.session
            for r in sim.interactive
            if r.done_at is not None and r.turn == len(trace.sessions[r.session].turns) - 1
        }
        live.append(len(started - finished))
        batch.append(statistics.mean(len(w.decoding) for w in sim.fleet.decoders))
    sim.finish()
    o = sim.outcomes()
    itl = [x.itl for x in o if x.itl]
    ttft = [x.ttft for x in o if x.ttft is not None and x.arrival >= 30.0]  # past the start-up burst
    return {
        "sessions": float(statistics.median(live[20:])),
        "tok_s_user": 1.0 / statistics.mean(itl),  # per user while it decodes
        "itl_p50_ms": pct(itl, 0.5) * 1e3,
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p90_s": pct(ttft, 0.9),
        "decode_batch": statistics.mean(batch),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleet", default="gb200-glm53")
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args(argv)
    spec = FleetSpec.load(a.fleet)
    runs = [measure(spec, seed) for seed in range(a.seeds)]
    got = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    got["kv_fp8"] = float(spec.with_kv(576).kv_tokens)
    got["kv_nvfp4"] = float(spec.with_kv(352).kv_tokens)
    print(f"{'figure':<34} {'published':>10} {'simulator':>10} {'off':>7}")
    names = {
        "sessions": "concurrent sessions per prefill group",
        "tok_s_user": "output tok/s per user",
        "kv_fp8": "KV tokens per decoder, FP8 (576 B)",
        "kv_nvfp4": "KV tokens per decoder, NVFP4 (352 B)",
    }
    for k, name in names.items():
        off = got[k] / PUBLISHED[k] - 1
        print(f"{name:<34} {PUBLISHED[k]:>10.4g} {got[k]:>10.4g} {off:>+6.0%} {'ok' if abs(off) <= 0.15 else 'MISS'}")
    print(
        f"(ITL p50 {got['itl_p50_ms']:.1f} ms, TTFT p50/p90 {got['ttft_p50_s']:.2f}/{got['ttft_p90_s']:.2f} s, "
        f"mean decode batch {got['decode_batch']:.1f} per decoder, {a.seeds} seeds, fleet {spec.name}: {spec.prefill_workers} prefill + {spec.decode_workers} decode engines)"
    )


if __name__ == "__main__":
    main()
