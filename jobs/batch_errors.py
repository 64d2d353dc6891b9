"""The entries of a batch's `errors` list (the batch object's `errors.data`, as OpenAI gives
them): what made a batch fail (validation, a quota) or end early (expiry before validation).

Stored as JSON on the batch row, so an entry is a plain dict of the four keys; `batch_error`
is the one place that builds one, and bounds its message."""

from __future__ import annotations

from typing import TypedDict

MESSAGE_CHARS = 500


class BatchError(TypedDict):
    code: str
    message: str
    param: str | None
    line: int | None  # the input line it is about; None for the whole batch


def batch_error(code: str, message: str, *, line: int | None = None, param: str | None = None) -> BatchError:
    return {"code": code, "message": message[:MESSAGE_CHARS], "param": param, "line": line}
