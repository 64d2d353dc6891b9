"""The fleet's reply to one request: its outcome, its token usage, and its body made JSON.

Its own module so that both the result records (`jobs.execution.results`) and the ledger
(`jobs.billing.ledger`) can name an `Outcome` without importing each other.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from backfill.jobs.errors import error_body


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
MAX_ERROR_MESSAGE = 4000
ENVELOPE_FIELDS = ("message", "type", "param", "code")


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


def error_envelope(parsed: Any, raw: bytes, status_code: int) -> dict[str, Any]:
    """A failed request's body in OpenAI's error envelope, `{"error": {"message", "type",
    "param", "code"}}`, keeping the fleet's own text and fields where it gave them.

    Clients read `response.body.error.message` of an error-file line; engines answer errors in
    several shapes (vLLM's envelope, a bare `{"message", "type", "code"}` object, FastAPI's
    `{"detail": ...}`, plain text from a proxy), so every shape is mapped to the one envelope."""
    inner: Any = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(inner, str):  # {"error": "text"}
        inner = {"message": inner}
    if not isinstance(inner, dict):
        inner = parsed if isinstance(parsed, dict) and "message" in parsed else {}
    message = inner.get("message")
    if not isinstance(message, str) or not message:
        if isinstance(parsed, dict) and isinstance(parsed.get("detail"), str):
            message = parsed["detail"]
        else:
            message = raw.decode("utf-8", "replace")
    error_type = inner.get("type")
    if not isinstance(error_type, str) or not error_type:
        error_type = "invalid_request_error" if 400 <= status_code < 500 else "server_error"
    param, code = inner.get("param"), inner.get("code")
    return error_body(
        message[:MAX_ERROR_MESSAGE],
        type_=error_type,
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, str | int) and not isinstance(code, bool) else None,
    )


def request_id_of(parsed: Any) -> str:
    """The request id for a result line when the fleet sent no `x-request-id`: the body's own id
    (`chatcmpl-...`, `resp_...`), else a fresh one, so every line names its request (an error
    body has no id of its own)."""
    body_id = parsed.get("id") if isinstance(parsed, dict) else None
    if isinstance(body_id, str) and body_id:
        return body_id
    return f"req_{uuid.uuid4().hex}"


def _fill_sdk_required(parsed: Any) -> bool:
    """Add the fields OpenAI's SDK requires and an engine left out; True when something was added.

    A `/v1/responses` body's `usage.input_tokens_details` must carry `cache_write_tokens`
    (`openai.types.responses.ResponseUsage`); vLLM writes only `cached_tokens`, so a client that
    validates with the SDK's models rejects every line. The engine wrote no cache, so 0 is true."""
    if not isinstance(parsed, dict) or parsed.get("object") != "response":
        return False
    usage = parsed.get("usage")
    details = usage.get("input_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict) and "cache_write_tokens" not in details:
        details["cache_write_tokens"] = 0
        return True
    return False


def _one_line(raw: bytes, parsed: Any) -> bytes:
    """The body's JSON on one line: result lines embed it as it is, so a line break in it would
    split a line of the output file in two. JSON escapes a line break inside a string, so a
    body without a newline or carriage-return byte is on one line already and is kept as the
    fleet sent it (found by a byte scan, far cheaper than serialising); one with them (pretty-
    printed, a trailing newline) is written again compactly from its parsed value."""
    if b"\n" in raw or b"\r" in raw:
        return orjson.dumps(parsed)
    return raw


def normalise_body(raw: bytes, status_code: int = 200) -> tuple[bytes, Any]:
    """The fleet's body as it goes into a result line, as single-line JSON bytes and parsed.

    A success keeps the fleet's bytes unless they span lines or a field the SDK requires was
    missing (then written again); a failure (or a body that is not JSON) becomes OpenAI's error
    envelope with the fleet's text."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None
        if 200 <= status_code < 300:
            status_code = 502  # a success must be JSON: the body is kept as the error's message
    if not 200 <= status_code < 300:
        inner = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(inner, dict) and set(ENVELOPE_FIELDS) <= inner.keys() and len(parsed) == 1:
            return _one_line(raw, parsed), parsed  # already OpenAI's envelope: the fleet's bytes
        parsed = error_envelope(parsed, raw, status_code)
        return orjson.dumps(parsed), parsed
    if _fill_sdk_required(parsed):
        return orjson.dumps(parsed), parsed
    return _one_line(raw, parsed), parsed


def outcome_of(status_code: int, raw: bytes, request_id: str | None) -> Outcome:
    """The fleet's reply to one request, parsed once: its body as a result line stores it, its
    request id (the fleet's `x-request-id`, else the body's own id) and its token usage."""
    body, parsed = normalise_body(raw, status_code)
    return Outcome(
        status_code=status_code,
        body=body,
        request_id=request_id or request_id_of(parsed),
        usage=usage_from_body(parsed),
    )
