"""Validation of a batch input file: every line checked, every problem reported with its line.

Valid batches get a compact request index (line, byte offset and length, custom_id, prompt
prefix fingerprint, token estimate) instead of one queue message per line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy import delete, insert, update
from sqlalchemy.orm import Session

from jobs.models import Batch, BatchRequest, BatchStatus, RequestState, utcnow
from jobs.quotas import quota_errors

PREFIX_CHARS = 1024
DEFAULT_MAX_OUTPUT_ESTIMATE = 1024


@dataclass
class Limits:
    max_requests: int
    max_line_bytes: int
    max_errors: int


@dataclass
class ValidationResult:
    errors: list[dict[str, Any]] = field(default_factory=list)
    error_count: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    model: str | None = None
    token_estimate: int = 0

    def add_error(self, limits: Limits, *, code: str, message: str, line: int | None, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < limits.max_errors:
            self.errors.append({"code": code, "message": message, "param": param, "line": line})


def iter_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, int, bytes]]:
    """Yield (1-based line number, byte offset, raw line without the newline)."""
    buf = b""
    offset = 0
    number = 0
    for chunk in chunks:
        buf += chunk
        start = 0
        while (nl := buf.find(b"\n", start)) >= 0:
            number += 1
            yield number, offset + start, buf[start:nl]
            start = nl + 1
        offset += start
        buf = buf[start:]
    if buf:
        yield number + 1, offset, buf


def prompt_text(endpoint: str, body: dict[str, Any]) -> str:
    """The text a prompt starts with, used for prefix grouping and token estimates."""
    if endpoint == "/v1/chat/completions":
        parts: list[str] = []
        for message in body.get("messages") or []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{message.get('role')}>{content if isinstance(content, str) else ''}")
        return "".join(parts)
    key = "input" if endpoint in ("/v1/embeddings", "/v1/responses") else "prompt"
    value = body.get(key)
    if isinstance(value, str):
        return value
    return orjson.dumps(value).decode() if value is not None else ""


def max_output_tokens(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_MAX_OUTPUT_ESTIMATE


def validate_lines(
    chunks: Iterable[bytes],
    *,
    endpoint: str,
    served_models: set[str] | None,
    limits: Limits,
) -> ValidationResult:
    result = ValidationResult()
    seen_ids: set[str] = set()
    models: dict[str, int] = {}
    count = 0
    for number, offset, raw in iter_lines(chunks):
        line = raw.rstrip(b"\r")
        if not line.strip():
            continue
        count += 1
        if count > limits.max_requests:
            result.add_error(
                limits,
                code="too_many_requests",
                message=f"The file has more than {limits.max_requests} requests, the most a batch may hold.",
                line=number,
            )
            break
        if len(line) > limits.max_line_bytes:
            result.add_error(
                limits,
                code="line_too_large",
                line=number,
                message=f"Line is {len(line)} bytes; the limit is {limits.max_line_bytes}.",
            )
            continue
        request = _check_line(result, limits, line, number, endpoint, seen_ids)
        if request is None:
            continue
        model = request["body"].get("model")
        models.setdefault(model, number)
        text = prompt_text(endpoint, request["body"])
        estimate = (
            len(text.encode()) // 4 + 1 + (0 if endpoint == "/v1/embeddings" else max_output_tokens(request["body"]))
        )
        result.token_estimate += estimate
        result.requests.append(
            {
                "line": number,
                "custom_id": request["custom_id"],
                "offset": offset,
                "length": len(raw),
                "prefix_hash": hashlib.blake2b(text[:PREFIX_CHARS].encode(), digest_size=8).hexdigest(),
                "token_estimate": estimate,
            }
        )
    if count == 0:
        result.add_error(limits, code="empty_file", message="The input file has no requests.", line=None)
    if len(models) > 1:
        (first, _), *others = sorted(models.items(), key=lambda kv: kv[1])
        for model, number in others:
            result.add_error(
                limits,
                code="mismatched_model",
                line=number,
                param="body.model",
                message=f"Model {model!r} differs from {first!r} on line {models[first]}: a batch uses one model.",
            )
    if len(models) == 1:
        result.model = next(iter(models))
        if served_models is not None and result.model not in served_models:
            result.add_error(
                limits,
                code="model_not_found",
                line=models[result.model],
                param="body.model",
                message=(
                    f"The model {result.model!r} is not served here. Available: {', '.join(sorted(served_models))}."
                ),
            )
    if result.error_count > len(result.errors):
        result.errors.append(
            {
                "code": "too_many_errors",
                "message": f"{result.error_count - len(result.errors)} more errors were not listed.",
                "param": None,
                "line": None,
            }
        )
    return result


def _check_line(
    result: ValidationResult, limits: Limits, line: bytes, number: int, endpoint: str, seen_ids: set[str]
) -> dict[str, Any] | None:
    def fail(code: str, message: str, param: str | None = None) -> None:
        result.add_error(limits, code=code, message=message, line=number, param=param)

    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        fail("invalid_json_line", f"This line is not valid JSON: {exc}.")
        return None
    if not isinstance(obj, dict):
        fail("invalid_request", "Each line must be a JSON object.")
        return None
    ok = True
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        fail("missing_custom_id", "Each request needs a non-empty string 'custom_id'.", "custom_id")
        ok = False
    elif len(custom_id) > 512:
        fail("invalid_custom_id", "'custom_id' is longer than 512 characters.", "custom_id")
        ok = False
    elif custom_id in seen_ids:
        fail("duplicate_custom_id", f"The custom_id {custom_id!r} is used more than once.", "custom_id")
        ok = False
    else:
        seen_ids.add(custom_id)
    if obj.get("method") != "POST":
        fail("invalid_method", f"'method' must be 'POST', not {obj.get('method')!r}.", "method")
        ok = False
    if obj.get("url") != endpoint:
        fail("invalid_url", f"'url' is {obj.get('url')!r}; this batch's endpoint is {endpoint!r}.", "url")
        ok = False
    body = obj.get("body")
    if not isinstance(body, dict):
        fail("invalid_body", "'body' must be a JSON object.", "body")
        return None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        fail("missing_model", "'body.model' must name a model.", "body.model")
        ok = False
    if body.get("stream") is True:
        fail("streaming_not_supported", "Batch requests cannot stream: remove 'stream: true'.", "body.stream")
        ok = False
    return obj if ok else None


def apply_validation(session: Session, *, batch_id: str, result: ValidationResult) -> str:
    """Record the outcome. Idempotent: a redelivered validation replaces its own earlier index."""
    batch = session.get(Batch, batch_id, with_for_update=True)
    if batch is None or batch.status not in (BatchStatus.validating, BatchStatus.cancelling):
        return batch.status if batch else "missing"
    now = utcnow()
    if not result.errors and result.model is not None and batch.status == BatchStatus.validating:
        # Over quota fails like any validation error: no request index, so nothing is dispatched.
        result.errors.extend(
            quota_errors(
                session,
                team_id=batch.team_id,
                model=result.model,
                batch_id=batch_id,
                token_estimate=result.token_estimate,
            )
        )
    if result.errors:
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status.in_([BatchStatus.validating, BatchStatus.cancelling]))
            .values(status=BatchStatus.failed, failed_at=now, errors=result.errors, model=result.model)
        )
        return BatchStatus.failed
    session.execute(delete(BatchRequest).where(BatchRequest.batch_id == batch_id))
    rows = [dict(r, batch_id=batch_id, state=RequestState.pending) for r in result.requests]
    for start in range(0, len(rows), 5000):
        session.execute(insert(BatchRequest), rows[start : start + 5000])
    values: dict[str, Any] = {
        "model": result.model,
        "total": len(rows),
        "token_estimate": result.token_estimate,
    }
    if batch.status == BatchStatus.validating:
        values.update(status=BatchStatus.in_progress, in_progress_at=now)
    session.execute(update(Batch).where(Batch.id == batch_id).values(**values))
    return str(values.get("status", batch.status))
