"""The lines of a batch's output and error files, in OpenAI's batch output format.

One formatter for every reader of finished lines: finalization (`jobs.output.finalize`) and the partial
output route write the same bytes for the same rows, so a line served while the batch runs is
the line its output file will hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from backfill.jobs.models import RequestState

ERROR_MESSAGES = {
    RequestState.cancelled: ("batch_cancelled", "This request was not executed because the batch was cancelled."),
    RequestState.expired: (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
}
OUTPUT_STATES = (RequestState.succeeded,)
# Pending lines of a settled batch (expired, or cancelled) are written as the batch ended: see
# `jobs.output.finalize.Plan.pending_as`. No claim takes a line of a batch that is not in progress.
ERROR_STATES = (RequestState.failed, RequestState.cancelled, RequestState.expired, RequestState.pending)

# The usage a batch reports: sums over its succeeded lines (only answered lines carry any).
USAGE_COLUMNS = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")

_ANSWER_LINE = b'{"id":%b,"custom_id":%b,"response":{"status_code":%b,"request_id":%b,"body":%b},"error":null}\n'
_ERROR_LINE = b'{"id":%b,"custom_id":%b,"response":null,"error":%b}\n'
# Keyed by the states' strings: rows carry plain strings, and a StrEnum member hashes as its value.
_ERROR_BODIES: dict[str, bytes] = {
    state: orjson.dumps({"code": code, "message": message}) for state, (code, message) in ERROR_MESSAGES.items()
}


def error_bodies(pending_as: RequestState) -> dict[str, bytes]:
    """The error body of each error state, a pending line written as `pending_as`."""
    return {**_ERROR_BODIES, RequestState.pending: _ERROR_BODIES[pending_as]}


def format_lines(rows: Iterable[Any], errors: dict[str, bytes]) -> bytes:
    """The lines of `rows` (line, result_id, custom_id, state, status_code, request_id,
    response_body, then any further columns, unread here)."""
    dumps = orjson.dumps
    answer_line, error_line = _ANSWER_LINE, _ERROR_LINE
    out = []
    for line, result_id, custom_id, state, status_code, request_id, body, *_ in rows:
        line_id = dumps(f"batch_req_{result_id}") if result_id else b'"batch_req_%d"' % line
        error = errors.get(state)
        if error is not None:
            out.append(error_line % (line_id, dumps(custom_id), error))
        else:
            out.append(
                answer_line
                % (
                    line_id,
                    dumps(custom_id),
                    b"null" if status_code is None else b"%d" % status_code,
                    dumps(request_id or ""),
                    (body or "null").encode(),
                )
            )
    return b"".join(out)
