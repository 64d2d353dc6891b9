"""Limits on what one request may take, enforced as pure ASGI before any parsing or thread:

- the bytes of its body, with or without Content-Length: 1 MiB for JSON routes, the file cap
  plus a small form allowance for `POST /v1/files`, the part cap (64 MiB) plus the same
  allowance for `POST /v1/uploads/{id}/parts`;
- for uploads (a file, an upload's part, an upload's completion, which may concatenate
  gigabytes), a slot among a bounded number in progress (in all and per API key), so slow
  or stalled uploads can never take the capacity other routes need: past the bound a client
  gets 429 with Retry-After at once instead of waiting.

The form inside an upload has its own caps (fields, field bytes, part headers), enforced by
the parser in `api.upload` with the numbers below.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backfill.jobs.errors import error_bytes
from backfill.jobs.teams import hash_key
from backfill.jobs.uploads import MAX_PART_BYTES
from backfill.storage.settings import get_settings

MAX_JSON_BODY = 1024 * 1024
UPLOAD_PATH = "/v1/files"
PART_PATH = re.compile(r"^/v1/uploads/[^/]+/parts/?$")
COMPLETE_PATH = re.compile(r"^/v1/uploads/[^/]+/complete/?$")

# The non-file fields of an upload: OpenAI's form has three (purpose, expires_after[anchor],
# expires_after[seconds]); room for a few more that are ignored, never for a flood.
MAX_FORM_FIELDS = 16
MAX_FORM_FIELD_BYTES = 64 * 1024
MAX_PART_HEADER_BYTES = 8 * 1024
# What a well-formed upload body may carry beside the file itself: fields, part headers, boundaries.
UPLOAD_OVERHEAD_BYTES = MAX_FORM_FIELD_BYTES + (MAX_FORM_FIELDS + 1) * (MAX_PART_HEADER_BYTES + 256)

UPLOAD_RETRY_AFTER_S = 5
DEFAULT_MAX_UPLOADS = 8
DEFAULT_MAX_UPLOADS_PER_KEY = 4


def max_concurrent_uploads() -> int:
    return max(1, get_settings().max_concurrent_uploads)


def max_concurrent_uploads_per_key() -> int:
    return max(1, get_settings().max_concurrent_uploads_per_key)


def is_file_upload(scope: Scope) -> bool:
    return bool(scope["method"] == "POST" and scope["path"].rstrip("/") == UPLOAD_PATH)


def is_part_upload(scope: Scope) -> bool:
    return bool(scope["method"] == "POST" and PART_PATH.match(scope["path"]))


def is_upload(scope: Scope) -> bool:
    """The requests that take an upload slot."""
    return (
        is_file_upload(scope)
        or is_part_upload(scope)
        or bool(scope["method"] == "POST" and COMPLETE_PATH.match(scope["path"]))
    )


def bearer_key_digest(scope: Scope) -> str | None:
    """SHA-256 of the request's bearer key (the same digest the keys table stores): limits are
    kept per key without ever holding or logging the key itself."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            return hash_key(token) if scheme.lower() == "bearer" and token else None
    return None


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    type_: str,
    code: str | None,
    param: str | None = None,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """OpenAI's error envelope, written straight to ASGI (these refusals happen outside FastAPI)."""
    body = error_bytes(message, type_=type_, param=param, code=code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _TooLarge(BaseException):
    """Raised out of `receive`; BaseException so FastAPI's body parser does not turn it into a 400."""


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int = MAX_JSON_BODY, max_upload_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # None: the configured file cap plus the form allowance, read at first use.
        self.max_upload_bytes = max_upload_bytes

    def _cap(self, upload: bool, part: bool) -> int:
        if part:
            return MAX_PART_BYTES + UPLOAD_OVERHEAD_BYTES
        if not upload:
            return self.max_bytes
        if self.max_upload_bytes is None:
            self.max_upload_bytes = get_settings().max_file_bytes + UPLOAD_OVERHEAD_BYTES
        return self.max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload, part = is_file_upload(scope), is_part_upload(scope)
        cap = self._cap(upload, part)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            await self._reject(send, cap, upload, part)
            return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reject(send, cap, upload, part)

    async def _reject(self, send: Send, cap: int, upload: bool, part: bool = False) -> None:
        if part:
            await send_error(
                send,
                413,
                f"A part is larger than the maximum of {MAX_PART_BYTES} bytes.",
                type_="invalid_request_error",
                code="part_too_large",
                param="data",
            )
            return
        if upload:
            message = f"File is larger than the maximum of {cap - UPLOAD_OVERHEAD_BYTES} bytes."
        else:
            message = f"Request body is larger than {cap} bytes."
        code = "file_too_large" if upload else "request_too_large"
        await send_error(send, 413, message, type_="invalid_request_error", code=code, param="file" if upload else None)


class UploadGate:
    """At most `max_uploads` uploads in progress, `max_per_key` of them for one API key.

    A slot is held from the first byte of the request to the last of the response. The gate
    runs before authentication; a request with a bad key holds its slot only until the 401,
    which comes before its body is read.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_uploads: int | None = None,
        max_per_key: int | None = None,
        retry_after_s: int = UPLOAD_RETRY_AFTER_S,
    ) -> None:
        self.app = app
        self.max_uploads = max_uploads or max_concurrent_uploads()
        self.max_per_key = max_per_key or max_concurrent_uploads_per_key()
        self.retry_after_s = retry_after_s
        # Only touched on the event loop between awaits, so plain counters are enough.
        self._active = 0
        self._per_key: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_upload(scope):
            await self.app(scope, receive, send)
            return
        key = bearer_key_digest(scope) or ""
        if self._active >= self.max_uploads or self._per_key.get(key, 0) >= self.max_per_key:
            mine = self._per_key.get(key, 0) >= self.max_per_key
            scope_words = f"for this API key ({self.max_per_key})" if mine else f"on this server ({self.max_uploads})"
            await send_error(
                send,
                429,
                f"Too many uploads in progress {scope_words}. Please try again in {self.retry_after_s}s.",
                type_="requests",
                code="rate_limit_exceeded",
                headers=((b"retry-after", str(self.retry_after_s).encode()),),
            )
            return
        self._active += 1
        self._per_key[key] = self._per_key.get(key, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._active -= 1
            left = self._per_key[key] - 1
            if left:
                self._per_key[key] = left
            else:
                del self._per_key[key]
