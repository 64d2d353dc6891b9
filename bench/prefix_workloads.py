"""The prefix benchmark's workloads, and the most of their prompt tokens any order could serve
from a prefix cache.

Prompts are pseudo-words (syllables) sized in the tiny model's own tokens. Every workload is
generated from a salt, so two runs never share text and one run's leftovers in the fleet's
cache cannot help the next.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path
from typing import Any

MODEL = "tiny-chat"
SYLLABLES = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]


@dataclass
class Workload:
    name: str
    label: str
    bodies: list[dict[str, Any]]
    shared: bool  # has prefixes to share (the control has none)
    samples: list[int] = field(default_factory=list)  # requests each body becomes (n); 1 if empty


class Tokens:
    """The tiny model's token stream of a request: its chat template, then its tokenizer, as
    the Dynamo frontend renders and tokenizes it."""

    def __init__(self, model_dir: Path) -> None:
        import jinja2
        from tokenizers import Tokenizer

        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        self._template = jinja2.Environment().from_string(config["chat_template"])
        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._special = {"bos_token": config["bos_token"], "eos_token": config["eos_token"]}

    def text(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def request(self, body: dict[str, Any]) -> list[int]:
        rendered = self._template.render(messages=body["messages"], add_generation_prompt=True, **self._special)
        return list(self._tok.encode(rendered, add_special_tokens=False).ids)


class Text:
    """Pseudo-word text of a given length in tokens (within a few percent)."""

    def __init__(self, tokens: Tokens, salt: str) -> None:
        self.tokens = tokens
        self.rng = random.Random(salt)
        sample = " ".join(self._word() for _ in range(2000))
        self.per_word = tokens.text(sample) / 2000

    def _word(self) -> str:
        return "".join(self.rng.choice(SYLLABLES) for _ in range(self.rng.randint(1, 3)))

    def __call__(self, n_tokens: int) -> str:
        return " ".join(self._word() for _ in range(max(1, round(n_tokens / self.per_word))))


def chat(messages: list[tuple[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": r, "content": c} for r, c in messages],
        "max_tokens": max_tokens,
        **extra,
    }


def eval_sweep(t: Text, *, tasks: int, questions: int, prefix_tokens: int = 2000) -> Workload:
    """Few-shot prefix per task (the same instructions and examples before every question)."""
    bodies = []
    for _ in range(tasks):
        shots = t(prefix_tokens)
        for q in range(questions // tasks):
            bodies.append(chat([("system", shots), ("user", f"Question {q}: {t(60)}")], 4))
    name = "eval" if tasks > 1 else "eval1"
    label = f"eval sweep, {tasks} few-shot prefix{'es' if tasks > 1 else ''} of {prefix_tokens} tok"
    return Workload(name, f"{label} x {len(bodies)} questions", bodies, shared=True)


def rollouts(t: Text, *, prompts: int, samples: int, prompt_tokens: int = 1000, as_n: bool = False) -> Workload:
    """RL rollouts: many samples of one prompt, as repeated lines or as one line with n."""
    bodies = []
    for _ in range(prompts):
        prompt = [("system", "Solve the task. Think step by step."), ("user", t(prompt_tokens))]
        if as_n:
            bodies.append(chat(prompt, 32, n=samples, temperature=1.0))
        else:
            bodies += [chat(prompt, 32, temperature=1.0) for _ in range(samples)]
    how = f"n={samples}" if as_n else f"{samples} samples"
    return Workload(
        "rollouts_n" if as_n else "rollouts",
        f"rollouts, {prompts} prompts of {prompt_tokens} tok x {how}",
        bodies,
        shared=True,
        samples=[samples] * len(bodies) if as_n else [],
    )


def system_prompts(t: Text, *, prompts: int, lines: int, prompt_tokens: int = 2000) -> Workload:
    systems = [t(prompt_tokens) for _ in range(prompts)]
    bodies = [chat([("system", systems[i % prompts]), ("user", t(80))], 16) for i in range(lines)]
    return Workload(
        "sysprompt", f"synthetic data, {prompts} system prompts of {prompt_tokens} tok x {lines} lines", bodies, True
    )


def agent_traces(t: Text, *, sessions: int, turns: int) -> Workload:
    """Agent sessions replayed turn by turn: each turn's prompt is the last one extended by the
    recorded answer and the next user (or tool) message."""
    system = t(500)
    bodies = []
    for _ in range(sessions):
        history = [("system", system)]
        for _ in range(turns):
            history.append(("user", t(100)))
            bodies.append(chat(list(history), 32))
            history.append(("assistant", t(150)))
    return Workload("agents", f"agent traces, {sessions} sessions x {turns} turns", bodies, shared=True)


def unique(t: Text, *, lines: int, prompt_tokens: int = 1000) -> Workload:
    bodies = [chat([("user", t(prompt_tokens))], 16) for _ in range(lines)]
    return Workload("unique", f"all-unique control, {lines} prompts of {prompt_tokens} tok", bodies, shared=False)


def max_cached_tokens(streams: list[list[int]], block: int = 64) -> int:
    """The most prompt tokens a prefix cache of unbounded size could serve, in any order.

    A request can be served at most its whole blocks before its last token (the engine
    computes at least one token); every distinct block must be computed once by someone.
    """
    seen: set[bytes] = set()
    total = 0
    for tokens in streams:
        whole = (len(tokens) - 1) // block if tokens else 0
        total += whole
        h = b""
        for i in range(whole):
            h = blake2b(h + repr(tokens[i * block : (i + 1) * block]).encode(), digest_size=16).digest()
            seen.add(h)
    return (total - len(seen)) * block


WORKLOADS: dict[str, Callable[[Text, float], Workload]] = {
    "eval1": lambda t, s: eval_sweep(t, tasks=1, questions=int(3000 * s)),
    "eval": lambda t, s: eval_sweep(t, tasks=16, questions=int(3000 * s)),
    "rollouts": lambda t, s: rollouts(t, prompts=max(2, int(64 * s)), samples=16),
    "sysprompt": lambda t, s: system_prompts(t, prompts=10, lines=int(1000 * s)),
    "agents": lambda t, s: agent_traces(t, sessions=max(2, int(200 * s)), turns=8),
    "unique": lambda t, s: unique(t, lines=int(1000 * s)),
    "rollouts_n": lambda t, s: rollouts(t, prompts=max(2, int(64 * s)), samples=16, as_n=True),
}
