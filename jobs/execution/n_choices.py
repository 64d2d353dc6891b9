"""Requests for `n` choices on a fleet that returns one (the Dynamo mocker; some engines).

Such a request is sent as n requests of one choice each, all at once so they share the
prompt's KV, and their answers are put back together as the one OpenAI response the client
asked for: choices indexed 0..n-1. Usage is what OpenAI bills for n choices: the prompt once
(the first request's prompt_tokens and its cached share), the completions of every choice, and
the total of the two; the n-1 extra prompt passes are the fleet's cost, not the client's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from backfill.jobs.endpoints import batch_endpoint

MAX_EXPANDED_N = 128  # OpenAI's own bound on n; a larger n goes to the fleet as it is


def split_n(endpoint: str, body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The one-choice requests standing for `body`, or None when it asks for one choice.

    A request with a seed gets seed, seed+1, ...: the same seed n times would give n equal
    samples, where the client asked for n different (and still reproducible) ones.
    """
    n = body.get("n")
    kind = batch_endpoint(endpoint)
    if not kind.expands_n or type(n) is not int or not 1 < n <= MAX_EXPANDED_N:
        return None
    one = {k: v for k, v in body.items() if k != "n"}
    seed = body.get("seed")
    if type(seed) is int:
        return [{**one, "seed": seed + i} for i in range(n)]
    return [dict(one) for _ in range(n)]


def merge_choices(parts: Sequence[bytes]) -> bytes:
    """One response from the bodies of successful one-choice responses, in request order."""
    merged: dict[str, Any] | None = None
    choices: list[Any] = []
    usage: dict[str, Any] = {}
    for raw in parts:
        body = orjson.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("a choice's response is not a JSON object")
        if merged is None:
            merged = body
        for choice in body.get("choices") or []:
            if isinstance(choice, dict):
                choice = {**choice, "index": len(choices)}
            choices.append(choice)
        if isinstance(body.get("usage"), dict):
            usage = _sum_counts(usage, body["usage"])
    if merged is None:
        raise ValueError("no responses to merge")
    merged = {**merged, "choices": choices}
    if usage:
        merged["usage"] = _prompt_once(usage, merged.get("usage"))
    return orjson.dumps(merged)


PROMPT_FIELDS = ("prompt_tokens", "prompt_tokens_details")


def _prompt_once(summed: dict[str, Any], first: Any) -> dict[str, Any]:
    """The summed usage with the prompt's counts put back to the first response's (it ran the
    prompt the client sent once), and the total recomputed from the two parts."""
    out = dict(summed)
    first = first if isinstance(first, dict) else {}
    for key in PROMPT_FIELDS:
        if key in first:
            out[key] = first[key]
        else:
            out.pop(key, None)
    prompt, completion = out.get("prompt_tokens"), out.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int) and "total_tokens" in out:
        out["total_tokens"] = prompt + completion
    return out


def _sum_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Field-wise sum of two usage objects (nested details too); non-counts keep the first."""
    out = dict(a)
    for key, value in b.items():
        mine = out.get(key)
        if isinstance(value, bool) or value is None:
            out.setdefault(key, value)
        elif isinstance(value, int | float) and (mine is None or isinstance(mine, int | float)):
            out[key] = (mine or 0) + value
        elif isinstance(value, dict) and (mine is None or isinstance(mine, dict)):
            out[key] = _sum_counts(mine or {}, value)
        else:
            out.setdefault(key, value)
    return out
