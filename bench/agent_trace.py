"""A replayable interactive trace: multi-turn agent sessions arriving in bursts and quiet periods.

Each session is an agent loop: a shared system prompt, then turns that each append a tool
result (a few hundred tokens) to the conversation and ask for a short reply, with a think time
in between. Prompts grow turn by turn and most of each prompt is the previous turn's prefix, so
the fleet's prefix cache matters as it does for real agents (scaled down from ~6K tokens added
per turn on prompts of up to ~140K to what the simulated fleet on two CPU cores can carry).

The trace is a pure function of its parameters and seed, so every run of the benchmark replays
exactly the same requests; only a per-run salt word changes (so no run inherits another's cache).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Words the tiny model's tokenizer holds as single tokens (it was trained on Python sources).
WORDS = (
    "def return self value import class lambda result None True False items append while print format "
    "string list dict tuple name path file open read write line data key index error raise except try "
    "finally with yield async await for if else elif not and or in is pass break continue global test "
    "config option default module package object method function argument parameter type int float str "
    "bytes bool len range sorted filter map zip sum max min any all next iter super init call repr hash "
    "time date stream buffer socket thread process queue lock event signal handler request response client "
    "server header body status code message text token parse match group pattern search replace split join"
).split()


@dataclass(frozen=True)
class Turn:
    tool_tokens: int  # new context appended before this turn's request
    max_tokens: int
    think_s: float  # pause after the reply, before the next turn


@dataclass(frozen=True)
class Session:
    sid: int
    start_s: float
    burst: bool
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class TraceSpec:
    duration_s: float = 90.0
    cycle_s: float = 30.0  # one burst + one quiet period
    burst_s: float = 12.0
    burst_sessions: int = 10
    quiet_sessions: int = 1
    system_tokens: int = 1200
    tool_tokens: tuple[int, int] = (300, 900)
    max_tokens: tuple[int, int] = (100, 200)
    think_s: tuple[float, float] = (1.0, 2.5)
    quiet_think_s: tuple[float, float] = (3.0, 6.0)
    seed: int = 7
    # bursts: `burst_sessions` start in each burst, `quiet_sessions` in each quiet period.
    # ramp: one compressed day over the whole trace, no cycles: sessions in flight rise smoothly
    # from `quiet_sessions` to `burst_sessions` at mid-trace and fall back (cycle_s, burst_s unused).
    shape: str = "bursts"


# Named traces for the harvest benchmark, so a control law is judged on more than one shape.
# `agent`: 14 s bursts of 10 sessions every 30 s with a 1.2K-token shared system prompt.
# `lulls`: long even waves (20 s of bursts, 20 s of near silence) of sessions with twice the
# system prompt and larger tool outputs: fewer, heavier prefills and longer idle stretches.
TRACES: dict[str, TraceSpec] = {
    "agent": TraceSpec(duration_s=120.0, cycle_s=30.0, burst_s=14.0),
    "lulls": TraceSpec(
        duration_s=120.0,
        cycle_s=40.0,
        burst_s=20.0,
        burst_sessions=8,
        quiet_sessions=0,
        system_tokens=2400,
        tool_tokens=(600, 1500),
        max_tokens=(80, 160),
        seed=11,
    ),
    # `ramp`: a diurnal ramp with no clean lull: 3-4 sessions in flight at the ends of the trace,
    # 8-11 in its middle, sessions starting at any time (not in waves), so the batch side never
    # gets an idle stretch; it has to find the room that a smoothly changing load leaves.
    "ramp": TraceSpec(duration_s=120.0, burst_sessions=8, quiet_sessions=3, seed=30, shape="ramp"),
}

RAMP_SESSION_S = (10.0, 20.0)  # how long a ramp session keeps taking turns
RAMP_STEP_S = 0.25


def build_trace(spec: TraceSpec) -> list[Session]:
    if spec.shape == "ramp":
        return _build_ramp(spec)
    if spec.shape != "bursts":
        raise ValueError(f"unknown trace shape {spec.shape!r}")
    rng = random.Random(spec.seed)
    sessions: list[Session] = []
    sid = 0
    cycle_start = 0.0
    while cycle_start < spec.duration_s - 1.0:
        burst_end = min(cycle_start + spec.burst_s, spec.duration_s)
        cycle_end = min(cycle_start + spec.cycle_s, spec.duration_s)
        for _ in range(spec.burst_sessions):
            start = cycle_start + rng.uniform(0.0, 0.3 * spec.burst_s)
            sessions.append(_session(rng, spec, sid, start, burst_end, spec.think_s, burst=True))
            sid += 1
        for _ in range(spec.quiet_sessions):
            if cycle_end - burst_end < 4.0:
                break
            start = rng.uniform(burst_end, max(burst_end, cycle_end - 4.0))
            sessions.append(_session(rng, spec, sid, start, cycle_end, spec.quiet_think_s, burst=False))
            sid += 1
        cycle_start += spec.cycle_s
    return sorted(sessions, key=lambda s: s.start_s)


def ramp_level(spec: TraceSpec, t: float) -> float:
    """Sessions in flight the ramp aims for at `t`: a raised cosine, trough at both ends."""
    lo, hi = spec.quiet_sessions, spec.burst_sessions
    return lo + (hi - lo) * (1.0 - math.cos(2.0 * math.pi * t / spec.duration_s)) / 2.0


def _build_ramp(spec: TraceSpec) -> list[Session]:
    """Sessions arrive at the rate that keeps `ramp_level` of them in flight (level / mean
    session length), drawn step by step, so arrivals are spread out rather than in waves."""
    rng = random.Random(spec.seed)
    mean_len = sum(RAMP_SESSION_S) / 2.0
    sessions: list[Session] = []

    def add(start: float) -> None:
        end = min(start + rng.uniform(*RAMP_SESSION_S), spec.duration_s)
        sessions.append(_session(rng, spec, len(sessions), start, end, spec.think_s, burst=False))

    # The trough's sessions are under way when the trace starts (staggered over the first seconds).
    for _ in range(spec.quiet_sessions):
        add(rng.uniform(0.0, 3.0))
    t = 0.0
    while t < spec.duration_s - 4.0:
        if rng.random() < ramp_level(spec, t) / mean_len * RAMP_STEP_S:
            add(t + rng.uniform(0.0, RAMP_STEP_S))
        t += RAMP_STEP_S
    return sorted(sessions, key=lambda s: s.start_s)


def _session(
    rng: random.Random, spec: TraceSpec, sid: int, start: float, end: float, think: tuple[float, float], *, burst: bool
) -> Session:
    # ~3 s per turn on an unloaded fleet (reply + think): as many turns as fit before `end`.
    turns = []
    t = start
    while True:
        turn = Turn(
            tool_tokens=rng.randint(*spec.tool_tokens),
            max_tokens=rng.randint(*spec.max_tokens),
            think_s=rng.uniform(*think),
        )
        turns.append(turn)
        t += turn.max_tokens * 0.012 + turn.think_s
        if t >= end or len(turns) >= 8:
            break
    return Session(sid=sid, start_s=start, burst=burst, turns=tuple(turns))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(spec: TraceSpec, salt: str) -> str:
    """Shared by every session of a run (agents share their instructions and tool schemas)."""
    return f"{salt} " + words(random.Random(spec.seed * 7919), spec.system_tokens)


def tool_output(spec: TraceSpec, session: Session, turn_index: int) -> str:
    rng = random.Random(spec.seed * 1_000_003 + session.sid * 101 + turn_index)
    return words(rng, session.turns[turn_index].tool_tokens)


def reply_stub(session: Session, turn_index: int, n_tokens: int) -> str:
    """What the agent appends as the assistant's reply (the mocker's text is random tokens)."""
    rng = random.Random(session.sid * 7 + turn_index)
    return words(rng, n_tokens)
