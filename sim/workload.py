"""Interactive traces for the simulator: sessions of turns, seeded, as data.

A trace is a list of sessions; a session is a start time and turns; a turn appends new context
(a user message or a tool's output) to the conversation and asks for a reply of `max_tokens`,
then the client thinks for `think_s` before the next turn. A session's turn k is sent only once
its turn k-1 has been answered (closed loop, as an agent or a chat user behaves); open-loop
traffic is sessions of one turn. All sessions share a system prompt of `system_tokens`.

File form (`backfill simulate --trace FILE`): JSON
`{"name": .., "duration_s": .., "system_tokens": .., "sessions": [{"start_s": .., "turns": [[new_tokens, max_tokens, think_s], ..]}, ..]}`.

Generators here (the agent, lulls and ramp traces live with the harvest benchmark):
- `burstgpt`: open-loop requests with Gamma-distributed gaps of shape 0.5 (bursty: coefficient of
  variation 1.4), the shape BurstGPT reports for ChatGPT/GPT-4 API traffic (Wang et al., 2024,
  "BurstGPT: A Real-world Workload Dataset to Optimize LLM Serving Systems": Gamma-fitted
  inter-arrival times, long-tailed request and response lengths); lengths here are lognormal.
- `azure_conv`: the Azure LLM inference trace's conversation service (Patel et al., 2024,
  "Splitwise", trace AzureLLMInferenceTrace_conv 2023: median prompt about 1020 tokens, median
  output about 129 tokens): lognormal lengths with those medians, Poisson arrivals whose rate
  swings +-60% over the trace (the trace's load varies minute to minute).
- `glm_agent`: the GB200 GLM-5.3 agent workload: waves of agent sessions, each turn adding about
  6K tokens to a prompt of up to 140K tokens (most of it the cached previous turn).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Turn:
    new_tokens: int
    max_tokens: int
    think_s: float


@dataclass(frozen=True)
class Session:
    start_s: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    system_tokens: int
    sessions: tuple[Session, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "duration_s": self.duration_s,
            "system_tokens": self.system_tokens,
            "sessions": [
                {"start_s": s.start_s, "turns": [[t.new_tokens, t.max_tokens, t.think_s] for t in s.turns]}
                for s in self.sessions
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trace:
        return cls(
            name=str(data.get("name", "trace")),
            duration_s=float(data["duration_s"]),
            system_tokens=int(data.get("system_tokens", 0)),
            sessions=tuple(
                Session(float(s["start_s"]), tuple(Turn(int(a), int(b), float(c)) for a, b, c in s["turns"]))
                for s in data["sessions"]
            ),
        )

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_json(json.loads(Path(path).read_text()))


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def burstgpt(seed: int, duration_s: float = 120.0, rate: float = 1.6) -> Trace:
    rng = random.Random(seed * 7919 + 1)
    sessions = []
    t = rng.uniform(0.0, 1.0)
    shape = 0.5
    while t < duration_s - 2.0:
        sessions.append(
            Session(t, (Turn(_lognormal(rng, 600, 0.9, 16, 6000), _lognormal(rng, 220, 0.8, 8, 1000), 0.0),))
        )
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
    return Trace("burstgpt", duration_s, 200, tuple(sessions))


def azure_conv(seed: int, duration_s: float = 120.0, rate: float = 1.4) -> Trace:
    rng = random.Random(seed * 104729 + 3)
    sessions = []
    t = 0.0
    phase = rng.uniform(0, 2 * math.pi)
    while t < duration_s - 2.0:
        level = rate * (1.0 + 0.6 * math.sin(2 * math.pi * t / 60.0 + phase))
        t += rng.expovariate(max(0.05, level))
        if t >= duration_s - 2.0:
            break
        sessions.append(
            Session(t, (Turn(_lognormal(rng, 1020, 0.8, 16, 8000), _lognormal(rng, 129, 0.9, 4, 1000), 0.0),))
        )
    return Trace("azure_conv", duration_s, 0, tuple(sessions))


def glm_agent(seed: int, duration_s: float = 120.0, sessions_peak: int = 66, wave_s: float = 60.0) -> Trace:
    """Agent waves on the GB200 fleet: `sessions_peak` sessions in the first half of each wave,
    a third of them in the second; each turn adds ~6K tokens, up to ~140K of context."""
    rng = random.Random(seed * 31337 + 5)
    sessions = []
    t0 = 0.0
    while t0 < duration_s - 5.0:
        for busy in (True, False):
            n = sessions_peak if busy else sessions_peak // 3
            span = wave_s / 2
            for _ in range(n):
                start = t0 + (0 if busy else span) + rng.uniform(0.0, 0.3 * span)
                if start >= duration_s - 5.0:
                    continue
                context = 0
                turns = []
                end = t0 + (span if busy else 2 * span)
                t = start
                while t < end and context < 140_000:
                    add = _lognormal(rng, 6000, 0.4, 500, 20000)
                    turns.append(Turn(add, rng.randint(300, 900), rng.uniform(2.0, 6.0)))
                    context += add + 600
                    t += 6.0
                sessions.append(Session(start, tuple(turns)))
        t0 += wave_s
    return Trace("glm_agent", duration_s, 4000, tuple(sorted(sessions, key=lambda s: s.start_s)))


GENERATORS: dict[str, Callable[[int], Trace]] = {"burstgpt": burstgpt, "azure_conv": azure_conv, "glm_agent": glm_agent}
