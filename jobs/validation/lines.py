"""Checking single lines of a batch input file: every rule a line must meet (`check_line`),
and what a valid line says (its prompt text, its output limit, its token estimate).

Everything here is bounded by a line, never by the user: a value that would overflow a column
is a line error before anything is stored, and a message quotes at most about QUOTE_CHARS
characters of a value. The common valid line takes a faster path (`jobs.validation.fast`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from backfill.jobs.endpoints import batch_endpoint
from backfill.jobs.errors import QUOTE_CHARS, quote
from backfill.jobs.models import Batch, BatchRequest, column_length

# Column bounds (jobs/models.py): Integer for a request's line, length and token estimate,
# BigInteger for a batch's token estimate; the strings' lengths read from their columns.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
CUSTOM_ID_MAX_CHARS = column_length(BatchRequest, "custom_id")
MODEL_MAX_CHARS = column_length(Batch, "model")
DEFAULT_MAX_OUTPUT_ESTIMATE = 1024
# orjson re-encodes at most this many levels, and the dispatcher re-encodes every body it sends.
MAX_BODY_DEPTH = 254
OUTPUT_LIMIT_KEYS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
COUNT_KEYS = (*OUTPUT_LIMIT_KEYS, "n")

# (code, message, param) of one problem on the line being checked.
ErrorSink = Callable[[str, str, "str | None"], None]


class SeenIds:
    """The custom_ids met so far, in the order met, with their line numbers in an array: a
    million ids cost their strings and a table entry each, no int object per line."""

    __slots__ = ("ids", "lines")

    def __init__(self) -> None:
        self.ids: dict[str, None] = {}  # a dict for its order; a set has none
        self.lines = array("i")

    def __contains__(self, custom_id: object) -> bool:
        return custom_id in self.ids

    def __len__(self) -> int:
        return len(self.lines)

    def add(self, custom_id: str, line: int) -> None:
        self.ids[custom_id] = None
        self.lines.append(line)


@dataclass(slots=True)  # not frozen: a frozen __init__ costs a tenth of a line's checking
class CheckedRequest:
    custom_id: str
    model: str | None  # None where the endpoint lets a body leave it out
    prompt: str
    token_estimate: int
    body: dict[str, Any]  # for prompt fingerprints that need the messages, not only their text
    output_tokens: int  # the most it may generate, all n completions together

    def values(self) -> FastRequest:
        """What `line_checker` gives for the same line."""
        n = self.body.get("n")
        return (
            self.custom_id,
            self.model,
            self.prompt,
            self.token_estimate,
            self.body,
            self.output_tokens,
            n if type(n) is int else 1,
        )


# What `line_checker` gives for a line it confirmed valid: custom_id, model, prompt (as
# prompt_text renders it), token estimate, body, output tokens (max_output_tokens, 0 for
# NO_OUTPUT_ENDPOINTS) and completions (n, 1 if not given): what check_line's CheckedRequest holds, and n.
FastRequest = tuple[str, str | None, str, int, dict[str, Any], int, int]


def check_line(
    line: bytes, *, endpoint: str, seen_ids: SeenIds, fail: ErrorSink, number: int = 0
) -> CheckedRequest | None:
    """Every rule one line must meet; each broken rule goes to `fail`. None if any broke.
    `seen_ids` holds the custom_ids met so far; this line's is added."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        fail("invalid_json_line", _not_json_message(line, exc), None)
        return None
    if not isinstance(obj, dict):
        fail("invalid_request", f"Each line must be a JSON object, not {quote(obj)}.", None)
        return None
    ok = _check_envelope(obj, endpoint=endpoint, seen_ids=seen_ids, fail=fail, number=number)
    body = obj.get("body")
    if not isinstance(body, dict):
        fail("invalid_body", f"'body' must be a JSON object, not {_given(obj, 'body')}.", "body")
        return None
    # The body is nested no deeper than the line has brackets: only count levels when it may be too deep.
    deep = line.count(b"{") + line.count(b"[") > MAX_BODY_DEPTH
    kind = batch_endpoint(endpoint)
    ok = _check_body(body, fail, deep=deep, model_optional=kind.model_optional) and ok
    if not ok:
        return None
    prompt = prompt_text(endpoint, body)
    output = max_output_tokens(body) if kind.produces_output else 0
    estimate = len(prompt.encode()) // 4 + 1 + output
    if estimate > INT32_MAX:
        fail(
            "invalid_value",
            f"This request may use about {estimate} tokens (its prompt plus n times its output limit); "
            f"a request may use at most {INT32_MAX}.",
            next((f"body.{k}" for k in OUTPUT_LIMIT_KEYS if body.get(k) is not None), None),
        )
        return None
    return CheckedRequest(obj["custom_id"], body.get("model"), prompt, estimate, body, output)


def _check_envelope(obj: dict[str, Any], *, endpoint: str, seen_ids: SeenIds, fail: ErrorSink, number: int) -> bool:
    ok = True
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        fail(
            "missing_custom_id",
            f"Each request needs a non-empty string 'custom_id', not {_given(obj, 'custom_id')}.",
            "custom_id",
        )
        ok = False
    elif len(custom_id) > CUSTOM_ID_MAX_CHARS:
        fail(
            "invalid_custom_id",
            f"'custom_id' is {len(custom_id)} characters long; the limit is {CUSTOM_ID_MAX_CHARS}.",
            "custom_id",
        )
        ok = False
    elif "\x00" in custom_id:
        fail("invalid_custom_id", f"'custom_id' {quote(custom_id)} contains a NUL character.", "custom_id")
        ok = False
    elif custom_id in seen_ids:
        fail("duplicate_custom_id", duplicate_id_message(custom_id), "custom_id")
        ok = False
    else:
        seen_ids.add(custom_id, number)
    if obj.get("method") != "POST":
        fail("invalid_method", f"'method' must be 'POST', not {_given(obj, 'method')}.", "method")
        ok = False
    if obj.get("url") != endpoint:
        fail("invalid_url", f"'url' is {_given(obj, 'url')}; this batch's endpoint is {endpoint!r}.", "url")
        ok = False
    return ok


def _check_body(body: dict[str, Any], fail: ErrorSink, *, deep: bool = True, model_optional: bool = False) -> bool:
    ok = True
    model = body.get("model")
    if model is None and model_optional:
        pass
    elif not isinstance(model, str) or not model:
        fail("missing_model", f"'body.model' must name a model, not {_given(body, 'model')}.", "body.model")
        ok = False
    elif len(model) > MODEL_MAX_CHARS or "\x00" in model:
        fail(
            "invalid_model",
            f"'body.model' {quote(model)} is not a model name: at most {MODEL_MAX_CHARS} characters, no NUL.",
            "body.model",
        )
        ok = False
    if body.get("stream") is True:
        fail("streaming_not_supported", "Batch requests cannot stream: remove 'stream: true'.", "body.stream")
        ok = False
    for key in COUNT_KEYS:
        value = body.get(key)
        # bool is an int to Python, not to JSON.
        if value is not None and (type(value) is not int or not 1 <= value <= INT32_MAX):
            fail(
                "invalid_value",
                f"'body.{key}' must be an integer from 1 to {INT32_MAX}, not {quote(value)}.",
                f"body.{key}",
            )
            ok = False
    if deep:
        try:  # what the dispatcher will do with it
            orjson.dumps(body)
        except orjson.JSONEncodeError:
            fail("invalid_body", f"'body' is nested more than {MAX_BODY_DEPTH} levels deep.", "body")
            ok = False
    return ok


def duplicate_id_message(custom_id: str) -> str:
    return f"The custom_id {quote(custom_id)} is used more than once."


def _given(obj: dict[str, Any], key: str) -> str:
    return quote(obj[key]) if key in obj else "missing"


def _not_json_message(line: bytes, exc: orjson.JSONDecodeError) -> str:
    try:
        line.decode()
    except UnicodeDecodeError as bad:
        return f"This line is not valid UTF-8: byte 0x{line[bad.start]:02x} at position {bad.start + 1}."
    return f"This line is not valid JSON: {str(exc)[:QUOTE_CHARS]}."


def prompt_text(endpoint: str, body: dict[str, Any]) -> str:
    """The text a prompt starts with, used for prefix grouping and token estimates."""
    key = batch_endpoint(endpoint).prompt_key
    if key == "messages":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        parts: list[str] = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            parts.append(f"<{role if isinstance(role, str) else ''}>{content if isinstance(content, str) else ''}")
        return "".join(parts)
    value = body.get(key)
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:  # too deep to re-encode: refused by _check_body already
        return ""


def max_output_tokens(body: dict[str, Any]) -> int:
    """The most output tokens a request may produce: its output limit, times n completions."""
    limit = DEFAULT_MAX_OUTPUT_ESTIMATE
    for key in OUTPUT_LIMIT_KEYS:
        value = body.get(key)
        if type(value) is int and value > 0:
            limit = value
            break
    n = body.get("n")
    return limit * n if type(n) is int and n > 0 else limit
