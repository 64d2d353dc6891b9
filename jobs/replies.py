"""The fleet's reply to one request: its outcome, its token usage, and its body made JSON.

Its own module so that both the result records (`jobs.results`) and the ledger
(`jobs.billing`) can name an `Outcome` without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class Outcome:
    """What the fleet answered for one request."""

    status_code: int
    body: bytes
    request_id: str | None
    usage: Usage

    @property
    def succeeded(self) -> bool:
        return 200 <= self.status_code < 300


INT32_MAX = 2**31 - 1


def usage_from_body(body: Any) -> Usage:
    """Token usage of a chat/completions/embeddings (prompt_*) or responses (input_*) body."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return Usage()

    def num(obj: Any, *keys: str) -> int:
        for key in keys:
            if not isinstance(obj, dict):
                return 0
            obj = obj.get(key)
        # Clamped to the int32 token columns: an absurd figure from the fleet must not make the
        # result unrecordable.
        return min(obj, INT32_MAX) if isinstance(obj, int) and obj >= 0 else 0

    return Usage(
        prompt_tokens=num(usage, "prompt_tokens") or num(usage, "input_tokens"),
        cached_tokens=num(usage, "prompt_tokens_details", "cached_tokens")
        or num(usage, "input_tokens_details", "cached_tokens"),
        completion_tokens=num(usage, "completion_tokens") or num(usage, "output_tokens"),
        reasoning_tokens=num(usage, "completion_tokens_details", "reasoning_tokens")
        or num(usage, "output_tokens_details", "reasoning_tokens"),
    )


def normalise_body(raw: bytes) -> tuple[bytes, Any]:
    """The fleet's body as JSON bytes (non-JSON is wrapped as an error object) and parsed."""
    try:
        parsed = orjson.loads(raw)
        return raw, parsed
    except orjson.JSONDecodeError:
        parsed = {"error": {"message": raw.decode("utf-8", "replace")[:4000], "type": "fleet_error"}}
        return orjson.dumps(parsed), parsed
