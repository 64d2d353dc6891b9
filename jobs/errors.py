"""Expected failures of the domain. The API maps each to one HTTP status in one table."""

from __future__ import annotations

import reprlib
from typing import Any, TypedDict

import orjson

# An error message quotes at most this much of a client's value.
QUOTE_CHARS = 100
_short = reprlib.Repr()
_short.maxstring = _short.maxother = _short.maxlong = 40


def quote(value: object) -> str:
    """A client's value for an error message: repr-like (control characters show), cut to about
    QUOTE_CHARS characters."""
    # Slice a string before repr so that quoting a 10 MB value costs nothing either.
    if isinstance(value, str):
        text = repr(value[:QUOTE_CHARS])
        return text if len(value) <= QUOTE_CHARS else f"{text}…"
    text = _short.repr(value)
    return text if len(text) <= QUOTE_CHARS + 2 else text[:QUOTE_CHARS] + "…"


def error_body(message: str, *, type_: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error envelope, `{"error": {"message", "type", "param", "code"}}`: the one place it
    is built, for the API's refusals and for the error lines of a batch's error file."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_bytes(message: str, *, type_: str, param: str | None = None, code: str | int | None = None) -> bytes:
    """`error_body` as JSON bytes, as a reply body carries it."""
    return orjson.dumps(error_body(message, type_=type_, param=param, code=code))


class DomainError(Exception):
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(DomainError):
    pass


class NotFound(DomainError):
    code = "not_found"


class Conflict(DomainError):
    """An illegal status transition, such as cancelling a completed batch."""

    code = "invalid_state"


class TooLarge(DomainError):
    code = "file_too_large"


class Unauthorized(DomainError):
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(DomainError):
    type = "permission_error"
    code = "insufficient_permissions"


# The entries of a batch's `errors` list (the batch object's `errors.data`, as OpenAI gives
# them): what made a batch fail (validation, a quota) or end early (expiry before validation).
#
# Stored as JSON on the batch row, so an entry is a plain dict of the four keys; `batch_error`
# is the one place that builds one, and bounds its message.

MESSAGE_CHARS = 500


class BatchError(TypedDict):
    code: str
    message: str
    param: str | None
    line: int | None  # the input line it is about; None for the whole batch


def batch_error(code: str, message: str, *, line: int | None = None, param: str | None = None) -> BatchError:
    return {"code": code, "message": message[:MESSAGE_CHARS], "param": param, "line": line}
